"""The engine on Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints against transformers' classes (fp32, their torch
delta rule): greedy tokens identical and log-probabilities close, through batching, chunked prefill beside
decodes, preemption (a preempted sequence recomputes from scratch on a fresh state slot), n > 1 (each sample
forks the prompt's state), and a prompt past 1,000 tokens, with the prefix cache on (state snapshots:
test_hybrid_prefix_cache.py covers its hits). Every state slot is back in the pool at the end."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, check_abort_mid_stream_frees_pages, hf_greedy
from hybrid_helpers import HYBRID_VOCAB, hybrid_tokens, transformers_class

from mili_openai import LLM, SamplingParams
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine

PROMPT_LENGTHS = [1, 5, 33, 70, 130, 1010]
MAX_NEW = 8
LAYOUTS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **kw)


@pytest.fixture(scope="module", params=LAYOUTS)
def oracle(request, hybrid_checkpoint):
    """(checkpoint, prompts, transformers' greedy tokens and logprob rows per prompt), once per layout."""
    checkpoint = hybrid_checkpoint(request.param)
    model = transformers_class(request.param).from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = [hybrid_tokens(length, seed=100 + length) for length in PROMPT_LENGTHS]
    return checkpoint, model, prompts, [hf_greedy(model, prompt, MAX_NEW) for prompt in prompts]


def assert_slots_released(llm: LLM) -> None:
    llm.core.check_integrity()
    slots = llm.core.state_slots
    assert slots is not None and slots.num_free == slots.num_slots


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=4096),  # whole prompts in one step, all batched
    dict(page_size=4, max_num_batched_tokens=61),  # odd chunks of prefill beside the others' decodes
], ids=["batched", "chunked"])
def test_greedy_matches_transformers(oracle, engine_args):
    checkpoint, _, prompts, expected = oracle
    llm = LLM(str(checkpoint), dtype="float32", num_pages=512, **engine_args)
    assert_matches(llm.generate(prompts, greedy()), expected)
    assert_slots_released(llm)


def test_preemption_recomputes_exactly(oracle):
    checkpoint, model, _, _ = oracle
    prompts = [hybrid_tokens(length, seed=length) for length in (20, 33, 41, 27, 38, 22)]
    expected = [hf_greedy(model, prompt, 24) for prompt in prompts]
    # 6 sequences of ~55 tokens need ~85 pages of 4; 30 pages force preemption and recomputation
    llm = LLM(str(checkpoint), dtype="float32", num_pages=30, page_size=4, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, greedy(max_tokens=24))
    assert llm.core.stats().num_preemptions_total > 0
    assert_matches(outputs, expected)
    assert_slots_released(llm)


def test_n_samples_fork_the_prompt_state(oracle):
    checkpoint, _, prompts, expected = oracle
    llm = LLM(str(checkpoint), dtype="float32", num_pages=256, page_size=16, max_num_batched_tokens=64)
    outputs = llm.generate(prompts[2:5], greedy(n=3))
    assert all(len(output.outputs) == 3 for output in outputs)
    assert_matches(outputs, expected[2:5])
    assert_slots_released(llm)


def test_abort_frees_the_state_slot(hybrid_checkpoint):
    engine = AsyncEngine(EngineConfig(model=str(hybrid_checkpoint("qwen3_5_qwen35_tokenizer")), dtype="float32",
                                      num_pages=64, page_size=8, max_num_batched_tokens=64, max_model_len=256))
    check_abort_mid_stream_frees_pages(engine, vocab=HYBRID_VOCAB)
    slots = engine.core.state_slots
    assert slots.num_free == slots.num_slots


def test_prefix_reuse_needs_snapshots(hybrid_checkpoint):
    checkpoint = str(hybrid_checkpoint("qwen3_next"))
    assert LLM(checkpoint, dtype="float32", num_pages=64).core.config.enable_prefix_caching
    # never K/V alone: with no room for a state snapshot, prefix reuse is off
    without_snapshots = LLM(checkpoint, dtype="float32", num_pages=64, num_hybrid_snapshots=0)
    assert not without_snapshots.core.config.enable_prefix_caching
    drafting = LLM(checkpoint, dtype="float32", num_pages=64, speculative_config={"num_speculative_tokens": 2})
    assert drafting.core.config.enable_prefix_caching and drafting.core.pages.snapshots is not None
