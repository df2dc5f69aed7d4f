"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next, MTP speculation, LoRA adapters and images on a CUDA device, against the
same oracles as their CPU tests: skipped where torch sees no GPU (CI has none; the GPU check runs it).

On CUDA the hybrids run Gated DeltaNet through the Triton conv and delta-rule kernels, attention through the
Triton page-table kernels, decode steps from CUDA graphs, and LoRA's deltas through the Triton SGMV kernel (in the
graphs too). The float32 oracles stay on the CPU (transformers, PEFT's merged adapters): a token that differs is the
GPU path's.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, greedy, hf_greedy, random_prompts
from hybrid_helpers import MTP_THREE, hybrid_tokens, transformers_class
from lora_helpers import peft_greedy
from vision_helpers import TEXT_ONLY, image_requests, transformers_greedy
from vision_helpers import greedy as image_greedy

from mili_openai import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

HYBRID_LAYOUTS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
HYBRID_PROMPT_LENGTHS = [1, 5, 33, 70, 130, 400]
MAX_NEW = 8
LORA_PROMPTS = random_prompts(3, [5, 23, 40], seed=11)


@pytest.fixture(scope="module", params=HYBRID_LAYOUTS)
def hybrid_oracle(request, hybrid_checkpoint):
    """(checkpoint, prompts, transformers' greedy tokens and logprob rows on the CPU), once per layout."""
    checkpoint = hybrid_checkpoint(request.param)
    model = transformers_class(request.param).from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = [hybrid_tokens(length, seed=100 + length) for length in HYBRID_PROMPT_LENGTHS]
    return checkpoint, prompts, [hf_greedy(model, prompt, MAX_NEW) for prompt in prompts]


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=4096),  # whole prompts in one step, all batched
    dict(page_size=4, max_num_batched_tokens=61),  # odd chunks of prefill beside the others' decodes
], ids=["batched", "chunked"])
def test_hybrid_greedy_on_cuda_matches_transformers(hybrid_oracle, engine_args):
    checkpoint, prompts, expected = hybrid_oracle
    llm = LLM(str(checkpoint), dtype="float32", device="cuda", num_pages=512, **engine_args)
    assert type(llm.core.runner.forward.model.backend.linear_attention).__name__.endswith("TritonLinearAttention")
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)
    graphs = llm.core.runner.forward.decode_graphs
    assert graphs is not None and graphs.steps_run > 0  # decode steps replayed, padded rows on the scratch slots
    # again: the prompts hit the prefix cache (pages and state snapshots), and no token may change
    second = llm.generate(prompts, greedy(MAX_NEW))
    assert_matches(second, expected)
    assert sum(output.num_cached_tokens for output in second) > 0
    llm.core.check_integrity()
    slots = llm.core.state_slots
    assert slots.num_free == slots.num_slots


def test_mtp_on_cuda_is_plain_greedy(hybrid_checkpoint):
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    prompts = [hybrid_tokens(4, seed=1) * 6, hybrid_tokens(13, seed=2), hybrid_tokens(41, seed=4)]
    engine = dict(dtype="float32", device="cuda", num_pages=256, page_size=4, max_num_batched_tokens=32)
    params = greedy(24)
    plain = [output.outputs[0].token_ids for output in LLM(checkpoint, **engine).generate(prompts, params)]
    llm = LLM(checkpoint, speculative_config=MTP_THREE, **engine)
    assert [output.outputs[0].token_ids for output in llm.generate(prompts, params)] == plain
    assert llm.core.stats().spec_decode_num_draft_tokens_total > 0
    llm.core.check_integrity()


def test_lora_adapters_mixed_on_cuda_match_peft(tiny_checkpoint, lora_adapters):
    names = ["r8", "r64", "rslora", None]
    oracle = {name: peft_greedy(tiny_checkpoint, lora_adapters.get(name), LORA_PROMPTS, MAX_NEW) for name in names}
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cuda", num_pages=256, page_size=8,
              max_num_batched_tokens=512, lora=dict(modules=list(lora_adapters.items()), max_lora_rank=64,
                                                    max_loras=4))
    assert llm.core.runner.forward.model.backend.lora.__module__.endswith("triton_lora")  # the SGMV kernel
    prompts = [prompt for _ in names for prompt in LORA_PROMPTS]
    outputs = llm.generate(prompts, greedy(MAX_NEW), lora_request=[name for name in names for _ in LORA_PROMPTS])
    for index, name in enumerate(names):
        assert_matches(outputs[index * len(LORA_PROMPTS):(index + 1) * len(LORA_PROMPTS)], oracle[name])
    graphs = llm.core.runner.forward.decode_graphs
    assert graphs is not None and graphs.steps_run > 0  # decode steps replayed, each step's adapters in its blocks
    llm.core.check_integrity()


@pytest.fixture(scope="module")
def image_oracle(vision_checkpoint, qwen35_tokenizer):
    """transformers' fp32 greedy tokens on the CPU for the image prompts (vision_helpers.PROMPTS), once."""
    import transformers

    return transformers_greedy(transformers.Qwen3_5ForConditionalGeneration, vision_checkpoint, qwen35_tokenizer)


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=2048),  # every prompt whole, in one batch
    dict(page_size=4, max_num_batched_tokens=37),  # odd chunks: images split across steps, beside decodes
], ids=["whole", "chunked"])
def test_images_on_cuda_match_transformers(vision_checkpoint, image_oracle, engine_args):
    """The vision tower (its projections, 2-D rotary and per-image attention) on the GPU, its embeddings placed
    in the hybrid decoder's prompt: the greedy tokens of transformers' fp32 generate on the CPU."""
    images, expected, (text_ids, text_tokens) = image_oracle
    llm = LLM(str(vision_checkpoint), dtype="float32", device="cuda", num_pages=256, **engine_args)
    assert next(llm.core.runner.forward.model.visual.parameters()).device.type == "cuda"
    outputs = llm.generate([*image_requests(images), TEXT_ONLY], image_greedy())
    for output, (ids, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == ids and output.outputs[0].token_ids == tokens
    assert outputs[-1].prompt_token_ids == text_ids and outputs[-1].outputs[0].token_ids == text_tokens
    llm.core.check_integrity()
