"""Speculative decoding on Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: greedy output with n-gram and MTP drafts is
token-identical to greedy output without drafts (fp32), with decodes verifying drafts in the same steps as
other sequences' prefill chunks, with preemption and n > 1. Drafts must be both kept and rejected, so the
linear layers' state rollback is exercised both ways (a kept draft leaves the slot where the verify pass
left it, a rejected one rolls it back to the last kept row). Every page and state slot is back at the end."""

from __future__ import annotations

import pytest

from hybrid_helpers import MTP_THREE, NGRAM, KnowingProposer, hybrid_tokens

from mili_openai import LLM, SamplingParams

LAYOUTS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MAX_NEW = 24
# prompts that repeat a pattern, so the tiny random models' continuations recur and n-gram drafts are kept
PATTERN_PROMPTS = [hybrid_tokens(4, seed=1) * 6, hybrid_tokens(13, seed=2), hybrid_tokens(3, seed=3) * 9,
                   hybrid_tokens(41, seed=4)]
ENGINE = dict(dtype="float32", num_pages=256, page_size=4, max_num_batched_tokens=32)  # chunks beside decodes
MTP_ONE = {"method": "mtp", "num_speculative_tokens": 1, "min_acceptance_rate": 0, "disable_by_batch_size": None}


def greedy(max_tokens: int = MAX_NEW, **params) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


def assert_all_released(llm: LLM) -> None:
    llm.core.check_integrity()
    slots = llm.core.state_slots
    assert slots.num_free == slots.num_slots


@pytest.fixture(scope="module", params=LAYOUTS)
def plain(request, hybrid_checkpoint):
    """(checkpoint, greedy tokens without drafts), once per layout."""
    checkpoint = str(hybrid_checkpoint(request.param))
    llm = LLM(checkpoint, **ENGINE)
    return checkpoint, token_ids(llm.generate(PATTERN_PROMPTS, greedy()))


@pytest.mark.parametrize("speculative", [NGRAM, MTP_ONE, MTP_THREE], ids=["ngram", "mtp1", "mtp3"])
def test_greedy_output_is_plain_decodings(plain, speculative):
    checkpoint, expected = plain
    llm = LLM(checkpoint, speculative_config=speculative, **ENGINE)
    assert token_ids(llm.generate(PATTERN_PROMPTS, greedy())) == expected
    stats = llm.core.stats()
    assert stats.spec_decode_num_draft_tokens_total > 0
    positions = stats.spec_decode_num_draft_tokens_per_pos
    assert len(positions) == speculative["num_speculative_tokens"] and sum(positions) == (
        stats.spec_decode_num_draft_tokens_total)
    assert_all_released(llm)


def test_kept_and_rejected_drafts_roll_the_state_exactly(plain):
    checkpoint, expected = plain
    llm = LLM(checkpoint, speculative_config=NGRAM, **ENGINE)
    llm.core.scheduler.proposer = KnowingProposer(PATTERN_PROMPTS, [sample[0] for sample in expected], k=3)
    assert token_ids(llm.generate(PATTERN_PROMPTS, greedy())) == expected
    stats = llm.core.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    kept, verified = stats.spec_decode_num_accepted_tokens_per_pos, stats.spec_decode_num_draft_tokens_per_pos
    assert all(0 < kept[position] < verified[position] for position in (0, 1))
    assert_all_released(llm)


def test_preemption_and_samples_with_mtp(hybrid_checkpoint):
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    prompts = [hybrid_tokens(length, seed=length) for length in (20, 33, 41, 27)]
    small = dict(ENGINE, num_pages=30)  # ~4 x 60 tokens need ~60 pages of 4: preemption and recomputation
    expected = token_ids(LLM(checkpoint, **small).generate(prompts, greedy(n=2)))
    llm = LLM(checkpoint, speculative_config=MTP_THREE, **small)
    assert token_ids(llm.generate(prompts, greedy(n=2))) == expected
    assert llm.core.stats().num_preemptions_total > 0
    assert_all_released(llm)


def test_mtp_needs_a_model_with_an_mtp_module(tiny_checkpoint):
    with pytest.raises(ValueError, match="MTP module"):
        LLM(str(tiny_checkpoint), dtype="float32", num_pages=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
