"""Tensor parallelism for Qwen3.5 / Qwen3-Next: Gated DeltaNet's heads (GVA groups whole), gated attention's heads,
the shared expert and the vocabulary split over two gloo ranks on CPU, each rank with a state pool of its own
heads, give exactly one rank's greedy tokens (and logprobs) through chunked prefill beside decodes, preemption
and n > 1, and with the prefix cache's state snapshots (each rank keeps its own heads'); sizes that do not split
the linear heads are refused naming them."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import random_prompts
from hybrid_helpers import HYBRID_VOCAB, NGRAM, hybrid_tokens

from mili_openai import LLM, SamplingParams
from mili_openai.model import ModelConfig
from mili_openai.model.hybrid_tensor_parallel import HybridShard
from mili_openai.model.tensor_parallel import check_tensor_parallel, shard_config

TP_SIZE = 2
# pages of 4 tokens and 40-token steps: prompts prefill in chunks beside decodes; 30 pages cannot hold every
# sequence at once, so some are preempted and recompute on a fresh state slot
ENGINE_ARGS = dict(dtype="float32", page_size=4, num_pages=30, max_num_batched_tokens=40)
PROMPT_LENGTHS = [3, 17, 45, 64]
MAX_NEW = 12


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=45, vocab=HYBRID_VOCAB)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    forked = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, n=2)
    return prompts, [greedy, forked, greedy, greedy]


def test_rank_shapes_split_the_linear_heads(hybrid_checkpoint):
    config = ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_next"))
    local = shard_config(config, TP_SIZE)
    linear = local.hybrid.linear
    assert (linear.num_key_heads, linear.num_value_heads) == (1, 2)  # 2 key heads over 4 value heads, halved
    assert local.moe.shared_expert_intermediate_size == config.moe.shared_expert_intermediate_size // TP_SIZE
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\)"):
        check_tensor_parallel(config, 4)  # 4 query heads would split, the 2 key heads of the linear layers not


def test_stacked_experts_split_like_per_expert_ones(hybrid_checkpoint):
    """transformers 5 may store experts stacked: (E, 2I, H) gate then up rows, (E, H, I) down."""
    config = ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_5_moe"))
    experts, size = config.moe.num_experts, config.moe.moe_intermediate_size
    gate, up = torch.randn(experts, size, config.hidden_size), torch.randn(experts, size, config.hidden_size)
    down = torch.randn(experts, config.hidden_size, size)
    half = size // TP_SIZE
    for rank in range(TP_SIZE):
        shard, rows = HybridShard(config, rank, TP_SIZE), slice(rank * half, (rank + 1) * half)
        stacked = shard.read("model.layers.0.mlp.experts.gate_up_proj", torch.cat((gate, up), dim=1))
        assert torch.equal(stacked, torch.cat((gate[:, rows], up[:, rows]), dim=1))
        assert torch.equal(shard.read("model.layers.0.mlp.experts.down_proj", down), down[:, :, rows])
        per_expert = shard.read("model.layers.0.mlp.experts.3.gate_proj.weight", gate[3])
        assert torch.equal(per_expert, gate[3, rows])


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_two_ranks_give_one_ranks_tokens(hybrid_checkpoint, layout):
    checkpoint = str(hybrid_checkpoint(layout))
    prompts, params = workload()
    single = LLM(checkpoint, **ENGINE_ARGS)
    want = single.generate(prompts, params)
    llm = LLM(checkpoint, tensor_parallel_size=TP_SIZE, **ENGINE_ARGS)
    try:
        got = llm.generate(prompts, params)
        assert llm.core.stats().num_preemptions_total > 0
        for got_output, want_output in zip(got, want, strict=True):
            for got_sample, want_sample in zip(got_output.outputs, want_output.outputs, strict=True):
                assert got_sample.token_ids == want_sample.token_ids
                for a, b in zip(got_sample.logprobs, want_sample.logprobs, strict=True):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        llm.core.check_integrity()
        assert llm.core.state_slots.num_free == llm.core.state_slots.num_slots
    finally:
        llm.core.runner.close()


def cached_calls(llm: LLM) -> list[list[tuple[list[int], int]]]:
    """Greedy tokens and cached-token counts of calls that hit the prefix cache: a prompt, the same again, two prompts
    branching off a shared prefix together, and a chat's next turn (the first reply resent)."""
    prompt = hybrid_tokens(33, seed=60)
    shared = hybrid_tokens(24, seed=61)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    calls: list[list[tuple[list[int], int]]] = []
    for prompts in ([prompt], [prompt], [shared + hybrid_tokens(9, seed=62), shared + hybrid_tokens(6, seed=63)]):
        calls.append([(o.outputs[0].token_ids, o.num_cached_tokens) for o in llm.generate(prompts, greedy)])
    turn = prompt + calls[0][0][0] + hybrid_tokens(7, seed=64)
    calls.append([(o.outputs[0].token_ids, o.num_cached_tokens) for o in llm.generate([turn], greedy)])
    return calls


def test_two_ranks_resume_from_their_own_snapshots(hybrid_checkpoint):
    """Each rank snapshots its own heads' states, in slots numbered alike, and restores them as one rank does: with
    the prefix cache on, two ranks hit where one does and give its tokens."""
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    engine_args = dict(ENGINE_ARGS, num_pages=64)
    want = cached_calls(LLM(checkpoint, **engine_args))
    assert all(call[-1][1] > 0 for call in want[1:])  # every call after the first hits
    llm = LLM(checkpoint, tensor_parallel_size=TP_SIZE, **engine_args)
    try:
        assert llm.core.config.enable_prefix_caching and llm.core.runner.num_state_snapshots > 0
        assert cached_calls(llm) == want
        llm.core.check_integrity()
        assert llm.core.stats().num_state_snapshots_attached > 0
    finally:
        llm.core.runner.close()


def test_speculation_over_ranks_is_refused(hybrid_checkpoint):
    """The workers do not roll linear states back to the last kept draft: refused at start, not wrong tokens."""
    with pytest.raises(ValueError, match="linear-attention layers runs on one rank"):
        LLM(str(hybrid_checkpoint("qwen3_5")), tensor_parallel_size=TP_SIZE, speculative_config=NGRAM, **ENGINE_ARGS)
