"""Greedy bf16 output on the compiled CPU kernels does not depend on speculation: a decode row verifying drafts
computes the same bits as the plain decode of that token (the kernels' matmul and decode attention are batch
invariant, tests/kernels/test_batch_invariance.py), so the tokens and their logprobs are plain decoding's to the
last bit, with drafts kept whole, in part and not at all. A random model's greedy continuation tips at any
rounding change; this is what lets a fitted MTP head's acceptance hold when served (docs/speculative.md).

One sequence at a time: a verify step of 1 + 3 rows stays within the rows the matmul kernel takes (beyond them
a GEMM, which is not batch invariant). Skipped where the CPU has no AVX512-BF16 pair products."""

from __future__ import annotations

import pytest

from hybrid_helpers import MTP_THREE, KnowingProposer, hybrid_tokens

from mili_openai import LLM, SamplingParams
from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels

PROMPTS = [hybrid_tokens(37, seed=31), hybrid_tokens(70, seed=32)]
ENGINE = dict(dtype="bfloat16", page_size=16, num_pages=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
ALL_DRAFTED = {"method": "ngram", "num_speculative_tokens": 3}  # the proposer is replaced below
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 3, "min_acceptance_rate": 0,
               "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def plain(hybrid_checkpoint):
    """(checkpoint, each prompt's greedy tokens and their logprobs without drafts, one prompt at a time)."""
    if not cpu_supports_kernels() or not load_cpu_kernels().bf16_dot_products:
        pytest.skip("batch invariance needs the CPU kernels with bf16 pair products (AVX512-BF16)")
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    llm = LLM(checkpoint, **ENGINE)
    return checkpoint, [outputs(llm, prompt) for prompt in PROMPTS]


def outputs(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    completion = llm.generate([prompt], GREEDY)[0].outputs[0]
    return list(completion.token_ids), [entry.logprob for entry in completion.logprobs]


def test_kept_and_rejected_drafts_leave_the_bits_unchanged(plain):
    checkpoint, expected = plain
    llm = LLM(checkpoint, speculative_config=ALL_DRAFTED, **ENGINE)
    llm.core.scheduler.proposer = KnowingProposer(PROMPTS, [tokens for tokens, _ in expected], k=3)
    assert [outputs(llm, prompt) for prompt in PROMPTS] == expected
    stats = llm.core.stats()
    kept, verified = stats.spec_decode_num_accepted_tokens_per_pos, stats.spec_decode_num_draft_tokens_per_pos
    assert all(0 < kept[position] < verified[position] for position in (0, 1))


def test_a_draft_model_leaves_the_bits_unchanged(plain):
    """The target as its own Qwen3.5 draft (its drafts mostly kept): beside a draft model the target's prefill
    chunks stop where they stop without one (the prefix cache's state snapshots at page boundaries), so its
    rounding, and its greedy output, are plain decoding's."""
    checkpoint, expected = plain
    llm = LLM(checkpoint, speculative_config=DRAFT_MODEL | {"model": checkpoint}, **ENGINE)
    assert llm.core.runner.num_state_snapshots > 0
    assert [outputs(llm, prompt) for prompt in PROMPTS] == expected
    assert llm.core.stats().spec_decode_num_accepted_tokens_total > 0


def test_mtp_drafts_leave_the_bits_unchanged(plain):
    checkpoint, expected = plain
    llm = LLM(checkpoint, speculative_config=MTP_THREE, **ENGINE)
    assert [outputs(llm, prompt) for prompt in PROMPTS] == expected
    assert llm.core.stats().spec_decode_num_draft_tokens_total > 0
