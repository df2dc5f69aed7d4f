"""The prefix cache on hybrid models (engine/state_snapshots.py): a warm request resumes from a state snapshot
and its K/V pages, and its greedy tokens are transformers' fp32 ones, as a cold run's are. Covers a repeated
prompt, a branch point (two prompts sharing a prefix), a chat's next turns (the snapshot a finished request
leaves), n > 1, preemption, a snapshot pool too small for everything, abort, and speculative decoding (n-gram and
MTP drafts: states saved only at kept positions). After each test the snapshot
ids are all free or attached to the tree, and all free once the tree is reset."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, check_abort_mid_stream_frees_pages, greedy, hf_greedy
from hybrid_helpers import HYBRID_VOCAB, MTP_THREE, NGRAM, hybrid_tokens, transformers_class

from mili_openai import LLM
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine

MAX_NEW = 8
PAGE = 4
SHARED = hybrid_tokens(40, seed=7)  # a shared prefix of whole pages
TAILS = [hybrid_tokens(9, seed=8), hybrid_tokens(13, seed=9), hybrid_tokens(7, seed=10)]
TURN_MESSAGES = [hybrid_tokens(29, seed=20), hybrid_tokens(11, seed=21), hybrid_tokens(6, seed=22)]
PATTERN = hybrid_tokens(5, seed=6) * 5  # a prompt that repeats itself: n-gram drafts find matches in it


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def oracle(request, hybrid_checkpoint):
    """(checkpoint, {name: (prompt, transformers' greedy tokens and logprob rows)}), once per layout: two prompts
    sharing SHARED, and a chat of three turns, each resending the history with the model's reply."""
    checkpoint = hybrid_checkpoint(request.param)
    model = transformers_class(request.param).from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    cases = {f"branch{i}": SHARED + tail for i, tail in enumerate(TAILS)} | {"pattern": PATTERN}
    expected = {name: (prompt, hf_greedy(model, prompt, MAX_NEW)) for name, prompt in cases.items()}
    history: list[int] = []
    for turn, message in enumerate(TURN_MESSAGES):
        prompt = history + message
        expected[f"turn{turn}"] = (prompt, hf_greedy(model, prompt, MAX_NEW))
        history = prompt + expected[f"turn{turn}"][1][0]
    return checkpoint, expected


def make_llm(checkpoint, **engine_args) -> LLM:
    return LLM(str(checkpoint), dtype="float32", page_size=PAGE, **{"num_pages": 256, **engine_args})


def run(llm: LLM, oracle, names: list[str], **params):
    """Generate the named prompts in one call; check them against the oracle; their cached-token counts."""
    _, expected = oracle
    outputs = llm.generate([expected[name][0] for name in names], greedy(MAX_NEW, **params))
    assert_matches(outputs, [expected[name][1] for name in names])
    return [output.num_cached_tokens for output in outputs]


def assert_snapshots_accounted(llm: LLM) -> None:
    """Every snapshot id free or attached (none held by a sequence), and all free once the tree is reset."""
    core = llm.core
    core.check_integrity()
    store = core.pages.snapshots.store
    assert store.num_free + store.num_attached == store.num_snapshots
    core.pages.tree.reset()
    assert store.num_free == store.num_snapshots
    core.check_integrity()


def test_a_repeated_prompt_resumes_from_its_snapshot(oracle):
    llm = make_llm(oracle[0], max_num_batched_tokens=24)
    prompt = oracle[1]["turn0"][0]
    assert run(llm, oracle, ["turn0"]) == [0]
    assert run(llm, oracle, ["turn0"]) == [(len(prompt) - 1) // PAGE * PAGE]
    stats = llm.core.stats()
    assert stats.prefix_cache_hits_total > 0 and stats.num_state_snapshots_attached > 0
    assert_snapshots_accounted(llm)


def test_a_chats_next_turns_resume_after_the_reply(oracle):
    llm = make_llm(oracle[0], max_num_batched_tokens=32)
    for turn in range(len(TURN_MESSAGES)):
        cached = run(llm, oracle, [f"turn{turn}"])[0]
        if turn:  # the snapshot the previous turn left at its last page boundary (its last token is never fed)
            previous = len(oracle[1][f"turn{turn - 1}"][0]) + MAX_NEW - 1
            assert cached == previous // PAGE * PAGE
    assert_snapshots_accounted(llm)


def test_a_branch_point_is_snapshotted_for_the_prompt_that_waits(oracle):
    llm = make_llm(oracle[0], max_num_batched_tokens=64)
    assert run(llm, oracle, ["branch0", "branch1"]) == [0, len(SHARED)]
    assert_snapshots_accounted(llm)


def test_a_branch_point_is_snapshotted_for_a_prompt_that_admission_has_not_reached(oracle):
    """A budget of 16 tokens admits only branch0 at first: branch1 waits in the queue while branch0 passes
    SHARED's end, and still finds a snapshot there when it is admitted."""
    llm = make_llm(oracle[0], max_num_batched_tokens=16)
    assert run(llm, oracle, ["branch0", "branch1"]) == [0, len(SHARED)]
    assert_snapshots_accounted(llm)


def test_a_branch_point_is_snapshotted_by_a_later_prompt_that_leaves_the_path(oracle):
    """branch1 comes after branch0 has finished: its K/V matches SHARED but no state was saved there, so it
    runs cold and saves one as it passes; branch2 then resumes from it."""
    llm = make_llm(oracle[0], max_num_batched_tokens=64)
    assert [run(llm, oracle, [name])[0] for name in ("branch0", "branch1", "branch2")] == [0, 0, len(SHARED)]
    assert_snapshots_accounted(llm)


def test_n_samples_resume_from_the_prompts_snapshot(oracle):
    llm = make_llm(oracle[0], max_num_batched_tokens=64)
    outputs = llm.generate([oracle[1]["turn1"][0]], greedy(MAX_NEW, n=3))
    assert_matches(outputs, [oracle[1]["turn1"][1]])
    prompt = oracle[1]["turn1"][0]
    assert llm.core.stats().prefix_cache_hits_total == 2 * ((len(prompt) - 1) // PAGE * PAGE)
    assert_snapshots_accounted(llm)


def test_preemption_and_a_small_snapshot_pool(oracle):
    # 6 prompts of 40-60 tokens plus 8 outputs need ~90 pages of 4; 40 force preemption, and 2 snapshots
    # cannot hold every prompt's: they are evicted alone, and pages without one go first
    llm = make_llm(oracle[0], num_pages=40, max_num_batched_tokens=32, num_hybrid_snapshots=2)
    names = ["branch0", "branch1", "turn1", "turn2", "branch1", "turn0"]
    run(llm, oracle, names)
    stats = llm.core.stats()
    assert stats.num_preemptions_total > 0 and stats.num_state_snapshots == 2
    run(llm, oracle, names[::-1])
    assert llm.core.stats().state_snapshots_evicted_total > 0
    assert_snapshots_accounted(llm)


def test_no_prefix_caching_allocates_no_snapshots(oracle):
    llm = make_llm(oracle[0], enable_prefix_caching=False)
    assert llm.core.pages.snapshots is None and llm.core.runner.num_state_snapshots == 0
    assert run(llm, oracle, ["turn0", "turn0"]) == [0, 0]


def test_abort_returns_every_snapshot(hybrid_checkpoint):
    engine = AsyncEngine(EngineConfig(model=str(hybrid_checkpoint("qwen3_5_qwen35_tokenizer")), dtype="float32",
                                      num_pages=64, page_size=8, max_num_batched_tokens=64, max_model_len=256))
    check_abort_mid_stream_frees_pages(engine, vocab=HYBRID_VOCAB)
    store = engine.core.pages.snapshots.store
    assert store.num_free + store.num_attached == store.num_snapshots
    engine.core.pages.tree.reset()
    assert store.num_free == store.num_snapshots


@pytest.mark.parametrize("speculative", [NGRAM, MTP_THREE], ids=["ngram", "mtp3"])
def test_drafts_save_snapshots_only_at_kept_positions(oracle, speculative):
    """Beside speculative decoding a verify step's rows cross page boundaries; the state is saved from the row that
    reaches one only where its token was kept, so the next turn resumes after the reply with the very tokens."""
    llm = make_llm(oracle[0], max_num_batched_tokens=32, speculative_config=speculative)
    for turn in range(len(TURN_MESSAGES)):
        cached = run(llm, oracle, [f"turn{turn}"])[0]
        if turn:  # as without drafts: the last page boundary the previous turn's tokens reached
            previous = len(oracle[1][f"turn{turn - 1}"][0]) + MAX_NEW - 1
            assert cached == previous // PAGE * PAGE
    assert run(llm, oracle, ["branch0", "branch1"]) == [0, len(SHARED)]
    assert run(llm, oracle, ["pattern"]) == [0]
    assert run(llm, oracle, ["pattern"]) == [(len(PATTERN) - 1) // PAGE * PAGE]
    stats = llm.core.stats()
    assert stats.spec_decode_num_draft_tokens_total > 0  # kept drafts at a boundary: test_verified_snapshots.py
    assert_snapshots_accounted(llm)
