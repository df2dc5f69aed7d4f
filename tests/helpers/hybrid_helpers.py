"""Shared by the Qwen3.5 / Qwen3-Next tests: tiny checkpoint configs of each layout, the caches a hybrid model
runs on, and batches with state slots.

Shapes (after the brief of issue 45): hidden 64, 4 layers = 3 Gated DeltaNet + 1 gated attention, 2 key heads
over 4 value heads of 16 (GVA), attention 4 query / 2 KV heads of 32, partial rotary 0.25 (8 of 32 dims, mRoPE
sections [2, 1, 1] over its 4 pairs), a small vocabulary (the real 248,320 rows would make each oracle forward
of 1,000 tokens a gigabyte of logits), and one MTP layer.
"""

from __future__ import annotations

import random

import torch

from mili_openai.model import ForwardBatch, KVCache
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.hybrid_checkpoint import QWEN3_TOKENIZER, QWEN35_TOKENIZER
from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE
from mili_openai.model.state_cache import StateCache

HYBRID_VOCAB = 1024
TINY_HYBRID_CONFIG = dict(
    vocab_size=HYBRID_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
    mtp_num_hidden_layers=1)
# speculative configs whose drafts are both kept and rejected on the tiny models: n-gram drafts of up to 3
# tokens, and the checkpoint's MTP module chaining 3 (min_acceptance_rate 0: never switched off; no batch size
# limit: the tests draft in batches above the CPU's default)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
         "min_acceptance_rate": 0, "disable_by_batch_size": None}
MTP_THREE = {"method": "mtp", "num_speculative_tokens": 3, "min_acceptance_rate": 0, "disable_by_batch_size": None}
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
TINY_HYBRID_MOE_CONFIG = {k: v for k, v in TINY_HYBRID_CONFIG.items() if k != "intermediate_size"} | EXPERTS
# Qwen3-Next: plain partial RoPE, tied embeddings, and a dense layer among the sparse ones (mlp_only_layers)
TINY_NEXT_CONFIG = TINY_HYBRID_CONFIG | EXPERTS | dict(
    mlp_only_layers=[1], tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
# fixture name -> (layout, config fields, seed, tokenizer files); "qwen3_5_qwen35_tokenizer" carries Qwen3.5's own
# tokenizer and chat template over its whole vocabulary: what the server path needs (the XML tool-call parser is
# chosen from the template; a structured-output grammar covers every token the tokenizer has)
HYBRID_CHECKPOINTS = {
    "qwen3_5": ("qwen3_5", TINY_HYBRID_CONFIG, 10, QWEN3_TOKENIZER),
    "qwen3_5_vl": ("qwen3_5_vl", TINY_HYBRID_CONFIG, 11, QWEN3_TOKENIZER),
    "qwen3_5_moe": ("qwen3_5_moe", TINY_HYBRID_MOE_CONFIG, 12, QWEN3_TOKENIZER),
    "qwen3_next": ("qwen3_next", TINY_NEXT_CONFIG, 13, QWEN3_TOKENIZER),
    "qwen3_5_qwen35_tokenizer": ("qwen3_5", TINY_HYBRID_CONFIG | dict(vocab_size=QWEN35_VOCAB_SIZE), 14,
                                 QWEN35_TOKENIZER),
}


def transformers_class(layout: str):
    import transformers

    return {"qwen3_5": transformers.Qwen3_5ForCausalLM, "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
            "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM}[layout]


def hybrid_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(HYBRID_VOCAB) for _ in range(length)]


def hybrid_caches(model, num_pages: int, page_size: int, num_slots: int,
                  dtype: torch.dtype = torch.float32) -> ModelCaches:
    """The paged KV of the attention layers and `num_slots` zeroed state slots of the linear ones."""
    specs, device = model.cache_specs(), torch.device("cpu")
    return ModelCaches(KVCache(specs, num_pages, page_size, dtype, device), StateCache(specs, num_slots, dtype, device))


def with_state_slots(batch: ForwardBatch, decode: list[str], prefill: list[tuple[str, int]],
                     slots: dict[str, int]) -> ForwardBatch:
    """The batch with each decode row's, then each prefill chunk's, state slot."""
    keys = list(decode) + [key for key, _ in prefill]
    batch.state_slots = torch.tensor([slots[key] for key in keys], dtype=torch.int64)
    return batch


class KnowingProposer:
    """Drafts the plain output's next tokens, some with their first or second draft wrong: so drafts are kept
    whole, kept in part (the state rolls back to a row past the first) and rejected (random tiny models repeat
    too little for n-gram drafts to be kept, and their MTP heads are random)."""

    drafts_in_runner = False

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int) -> None:
        self.outputs = {tuple(prompt): output for prompt, output in zip(prompts, outputs)}
        self.k = k
        self.calls: dict[str, int] = {}

    def propose(self, seq, max_drafts: int) -> list[int]:
        done = len(seq.output_token_ids)
        drafts = list(self.outputs[tuple(seq.prompt_token_ids)][done : done + min(self.k, max_drafts)])
        calls = self.calls[seq.sequence_id] = self.calls.get(seq.sequence_id, 0) + 1
        wrong = {1: 0, 2: 1}.get(calls % 3)  # else every draft is right
        if wrong is not None and wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % HYBRID_VOCAB
        return drafts


class WrappedDrafter:
    """A test's wrapper around the runner's model proposer (engine/speculation.py's `Drafter`): every call but the
    ones a subclass defines (it looks at or changes `propose`) goes to it unchanged, the state calls included (a
    draft model's own states, zeroed or copied from a snapshot as the target's)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
