"""Speculative decoding with a draft model (`{"method": "draft_model", "model": PATH}`): greedy output is
token-identical to greedy output without drafts (fp32), for a dense Qwen3 target and a Qwen3.5 target, each with a
tiny draft of other layer shapes and with itself as the draft; in mixed batches (decodes verifying drafts beside
prefill chunks), with prefix hits, preemption and n > 1.

A random tiny draft almost never agrees with a random target, so the draft's own caches are checked through a
draft that is the target itself: its drafts are the target's greedy tokens wherever its K/V and states stand
where the target's do. A wrapper spoils some of its drafts, so drafts are kept whole, in part and not at all,
and the draft's caches must follow only the accepted tokens for the unspoiled drafts to keep being accepted.
Every page and state slot is back at the end."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hybrid_helpers import HYBRID_VOCAB, TINY_HYBRID_CONFIG, WrappedDrafter, hybrid_tokens
from model_helpers import random_tokens

from mili_openai import LLM, SamplingParams
from mili_openai.config import EngineConfig, speculative_config_from
from mili_openai.engine.memory_budget import BYTES_PER_GIB
from mili_openai.model import KVCache
from mili_openai.model.checkpoint import QWEN3_VOCAB_SIZE, ModelShape, build_random_checkpoint
from mili_openai.model.hybrid_checkpoint import QWEN3_TOKENIZER, build_random_hybrid_checkpoint
from mili_openai.model.qwen35_tokenizer import write_qwen35_tokenizer_files

MAX_NEW = 20
NUM_DRAFTS = 3
ENGINE = dict(dtype="float32", num_pages=256, page_size=4, max_num_batched_tokens=32)  # chunks beside decodes
BUDGET_ENGINE = {key: value for key, value in ENGINE.items() if key != "num_pages"}
SMALL_POOL = dict(ENGINE, num_pages=40)  # ~4 x 2 x 55 tokens need ~110 pages of 4: preemption and recomputation
DRAFT_SEED = 31
# a tiny Qwen3 draft of other shapes than the target's (TINY_SHAPE: hidden 64, 2 layers, 2 KV heads of 32)
TINY_DRAFT_SHAPE = ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16)
# a tiny Qwen3.5 draft: 1 Gated DeltaNet + 1 gated attention layer, narrower than the target's 4 layers
TINY_HYBRID_DRAFT_CONFIG = TINY_HYBRID_CONFIG | dict(hidden_size=32, num_hidden_layers=2,
                                                     layer_types=["linear_attention", "full_attention"],
                                                     mtp_num_hidden_layers=0)
SHARED_PREFIX = 16  # tokens two prompts share: four full pages, a prefix hit for the second


def dense_prompts() -> list[list[int]]:
    shared = random_tokens(SHARED_PREFIX, seed=40)
    return [shared + random_tokens(7, seed=41), random_tokens(29, seed=42), shared + random_tokens(11, seed=43),
            random_tokens(37, seed=44)]


def hybrid_prompts() -> list[list[int]]:
    """The second and third resume from the first's prefix: from its state snapshot, the draft's states too."""
    shared = hybrid_tokens(SHARED_PREFIX, seed=40)
    return [shared + hybrid_tokens(7, seed=23), hybrid_tokens(31, seed=31), shared + hybrid_tokens(11, seed=9),
            shared + hybrid_tokens(21, seed=37)]


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **params)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


def draft_config(path, **fields) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": NUM_DRAFTS,
            "min_acceptance_rate": 0, "disable_by_batch_size": None} | fields


def assert_all_released(llm: LLM) -> None:
    llm.core.check_integrity()
    assert llm.core.pages.tree.locked_pages == 0
    slots = llm.core.state_slots
    assert slots is None or slots.num_free == slots.num_slots


class SpoilingDrafter(WrappedDrafter):
    """Wraps the runner's drafter: of every three calls, one spoils each sequence's first draft and one its
    second, so drafts are rejected at the first and second position and kept whole otherwise."""

    def __init__(self, inner, vocab_size: int) -> None:
        super().__init__(inner)
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, *args) -> list[list[int]]:
        drafts = self.inner.propose(*args)
        self.calls += 1
        wrong = {1: 0, 2: 1}.get(self.calls % 3)
        for sequence_drafts in drafts:
            if wrong is not None and wrong < len(sequence_drafts):
                sequence_drafts[wrong] = (sequence_drafts[wrong] + 1) % self.vocab_size
        return drafts


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def target(request, tiny_checkpoint, hybrid_checkpoint, tmp_path_factory):
    """(name, checkpoint, tiny draft, prompts, vocabulary size, greedy tokens without drafts (n=2))."""
    if request.param == "dense":
        checkpoint, prompts, vocab = str(tiny_checkpoint), dense_prompts(), QWEN3_VOCAB_SIZE
        draft = build_random_checkpoint(tmp_path_factory.mktemp("draft-qwen3"), TINY_DRAFT_SHAPE, seed=DRAFT_SEED,
                                        dtype=torch.float32)
    else:
        checkpoint, prompts, vocab = str(hybrid_checkpoint("qwen3_5")), hybrid_prompts(), HYBRID_VOCAB
        draft = build_random_hybrid_checkpoint(tmp_path_factory.mktemp("draft-qwen3_5"), "qwen3_5",
                                               TINY_HYBRID_DRAFT_CONFIG, seed=DRAFT_SEED, tokenizer=QWEN3_TOKENIZER)
    expected = token_ids(LLM(checkpoint, **ENGINE).generate(prompts, greedy(n=2)))
    return request.param, checkpoint, str(draft), prompts, vocab, expected


def test_tiny_draft_gives_plain_decodings_output(target):
    _, checkpoint, draft, prompts, _, expected = target
    llm = LLM(checkpoint, speculative_config=draft_config(draft), **ENGINE)
    assert token_ids(llm.generate(prompts, greedy(n=2))) == expected
    stats = llm.core.stats()
    assert stats.spec_decode_num_draft_tokens_total > 0
    assert len(stats.spec_decode_num_draft_tokens_per_pos) == NUM_DRAFTS
    assert_all_released(llm)


def test_target_as_its_own_draft_is_accepted(target):
    """With the target's own weights, every draft is the target's greedy token where the draft's K/V and states
    cover exactly the accepted tokens: so nearly all are kept, after prefix hits too (a hybrid draft's states
    resume from the snapshot the target's resume from)."""
    _, checkpoint, _, prompts, _, expected = target
    llm = LLM(checkpoint, speculative_config=draft_config(checkpoint), **ENGINE)
    assert token_ids(llm.generate(prompts, greedy(n=2))) == expected
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens_total >= 0.9 * stats.spec_decode_num_draft_tokens_total > 0
    assert stats.prefix_cache_hits_total >= SHARED_PREFIX  # the later prompts resumed from the first's prefix
    assert_all_released(llm)


def test_rejected_drafts_leave_the_draft_after_the_accepted_tokens(target):
    _, checkpoint, _, prompts, vocab, expected = target
    llm = LLM(checkpoint, speculative_config=draft_config(checkpoint), **ENGINE)
    speculation = llm.core.runner.forward.speculation
    speculation.drafter = SpoilingDrafter(speculation.drafter, vocab)
    assert token_ids(llm.generate(prompts, greedy(n=2))) == expected
    stats = llm.core.stats()
    kept, verified = stats.spec_decode_num_accepted_tokens_per_pos, stats.spec_decode_num_draft_tokens_per_pos
    assert all(0 < kept[position] < verified[position] for position in (0, 1))
    # a third of first drafts are spoiled; the rest are the target's own tokens only if the draft's caches
    # were cut back to the accepted tokens after each rejection
    assert kept[0] >= 0.55 * verified[0]
    assert_all_released(llm)


def test_preemption_with_a_draft_model(target):
    _, checkpoint, _, prompts, _, _ = target
    expected = token_ids(LLM(checkpoint, **SMALL_POOL).generate(prompts, greedy(n=2)))
    llm = LLM(checkpoint, speculative_config=draft_config(checkpoint), **SMALL_POOL)
    assert token_ids(llm.generate(prompts, greedy(n=2))) == expected
    stats = llm.core.stats()
    assert stats.num_preemptions_total > 0
    assert stats.spec_decode_num_accepted_tokens_total >= 0.9 * stats.spec_decode_num_draft_tokens_total > 0
    assert_all_released(llm)


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint, hybrid_checkpoint):
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens"):
        LLM(str(tiny_checkpoint), speculative_config=draft_config(hybrid_checkpoint("qwen3_5")), **ENGINE)


def test_a_draft_with_another_tokenizer_is_refused(hybrid_checkpoint, tmp_path):
    """Same vocabulary size, other token ids: Qwen3.5's tokenizer files beside the Qwen3 one's model."""
    source = hybrid_checkpoint("qwen3_5")
    draft = Path(shutil.copytree(source, tmp_path / "draft"))
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        (draft / name).unlink(missing_ok=True)
    write_qwen35_tokenizer_files(draft)
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(str(source), speculative_config=draft_config(draft), **ENGINE)


def test_method_defaults_to_draft_model_where_a_model_is_given():
    assert speculative_config_from({"model": "/a/draft", "num_speculative_tokens": 2}).method == "draft_model"
    assert speculative_config_from({"num_speculative_tokens": 2}).method == "ngram"


def test_draft_model_is_refused_under_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"model": "/a/draft", "num_speculative_tokens": 2})


def test_the_drafts_pools_come_out_of_the_one_budget(target):
    """Each page costs the target's K/V bytes plus the draft's, each state slot (a hybrid's: the running ones and
    the prefix cache's snapshots) its states' too."""
    _, checkpoint, draft, _, _, _ = target
    budget_gb = 0.02
    runner = LLM(checkpoint, speculative_config=draft_config(draft), **BUDGET_ENGINE,
                 kv_cache_memory_gb=budget_gb).core.runner
    target_page = KVCache.bytes_per_page(runner.forward.cache_specs, runner.forward.page_size, runner.forward.dtype)
    draft_page = runner.forward.draft.page_bytes(runner.forward.page_size)
    slots = runner.num_state_slots + runner.num_state_snapshots
    states = slots * (runner.state_slot_bytes + runner.forward.draft.slot_bytes())
    assert draft_page > 0 and (runner.num_state_slots == 0 or runner.forward.draft.slot_bytes() > 0)
    assert runner.num_pages == (int(budget_gb * BYTES_PER_GIB) - states) // (target_page + draft_page)
    draft_caches = runner.forward.speculation.drafter.caches
    assert draft_caches.kv.num_pages == runner.forward.kv_cache.num_pages
    assert draft_caches.state is None or draft_caches.state.num_slots == slots


def test_a_next_turn_resumes_the_draft_from_a_decode_snapshot(hybrid_checkpoint):
    """A prompt that continues an earlier request's output resumes from the snapshot its decode saved at its last
    page boundary, which verify rows (3 drafts over pages of 4 tokens) mostly cross: the draft's states there must be
    the ones the row reaching the boundary left, or the draft's drafts after the hit are rejected."""
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    first_turn = hybrid_tokens(21, seed=5)
    llm = LLM(checkpoint, speculative_config=draft_config(checkpoint), **ENGINE)
    reply = list(llm.generate([first_turn], greedy())[0].outputs[0].token_ids)
    before = llm.core.stats()
    next_turn = first_turn + reply + hybrid_tokens(2, seed=6)
    assert token_ids(llm.generate([next_turn], greedy())) == token_ids(
        LLM(checkpoint, **ENGINE).generate([next_turn], greedy()))
    after = llm.core.stats()
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total >= len(first_turn)
    kept = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    drafted = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    assert kept >= 0.9 * drafted > 0
