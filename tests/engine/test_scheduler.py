"""The scheduler and page bookkeeping without a model: random workloads driven step by step.

`EngineCore` runs as the engine runs it, on a runner with no model: each step a counter stands in for the
model's samples, and `EngineCore.postprocess` takes them back (draft verification, finishing, prefix
caching). After every step the pages must be conserved (free + tree + owned == pool) and at the end
everything must finish with nothing locked. With `lookahead`, the driver plans each decode step's
successor before the step's tokens come back (`EngineCore.schedule_ahead`), as the async engine does.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import make_seq, speculative_scheduler

from mili_openai.config import EngineConfig, SpeculativeConfig
from mili_openai.engine.contract import check_request
from mili_openai.engine.core import EngineCore
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.sampler import SamplerOutput
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.scheduler import Scheduler, common_prefix_length
from mili_openai.engine.sequence import Sequence, SequenceStatus
from mili_openai.model import ModelConfig
from mili_openai.model.checkpoint import TINY_SHAPE, config_dict

MAX_STEPS = 2000


class ModelFreeRunner:
    """What `EngineCore` reads of a runner (engine/runner.py's `Runner`), without a model: the step driver
    makes up each step's samples, so a step has no inputs to prepare."""

    device = torch.device("cpu")
    model_config = ModelConfig.from_dicts(config_dict(TINY_SHAPE, torch.float32))
    quantization = None
    failure = None
    kernel_build = None
    async_launch = False
    state_slot_bytes = 0

    def __init__(self, num_pages: int, num_state_slots: int = 0, num_state_snapshots: int = 0) -> None:
        """num_state_slots, num_state_snapshots: as a hybrid model's runner has them (0: an attention-only model)."""
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots
        self.num_state_snapshots = num_state_snapshots

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> None:
        return None


class StepDriver:
    """An `EngineCore` on a `ModelFreeRunner`, one step at a time, checking every scheduled batch."""

    def __init__(self, tokenizer, num_pages: int, page_size: int, budget: int, max_seqs: int, caching: bool = True,
                 lookahead: bool = False, speculative: int = 0, snapshots: int | None = None) -> None:
        """snapshots: run as a hybrid model (a state slot per sequence) with this many state snapshots."""
        drafting = SpeculativeConfig(speculative, prompt_lookup_min=1, prompt_lookup_max=2,
                                     disable_by_batch_size=None) if speculative else None
        config = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_batched_tokens=budget,
                              max_num_seqs=max_seqs, enable_prefix_caching=caching, speculative_config=drafting)
        hybrid = (max_seqs, snapshots) if snapshots is not None else (0, 0)
        self.core = EngineCore(config, ModelFreeRunner(num_pages, *hybrid), tokenizer)
        self.pages = self.core.pages
        self.scheduler = self.core.scheduler
        self.lookahead = lookahead
        self.added: list[Sequence] = []
        # with drafts, a small alphabet, so that n-grams recur and the fake model agrees with some drafts
        self.next_token = itertools.cycle([0, 1, 2, 1, 1]) if speculative else itertools.count(1000)
        self.computed_tokens = 0
        self.in_flight: list[ScheduledBatch] = []  # scheduled, tokens not back yet (oldest first)
        self.fed_pending = 0  # decodes whose input token was still pending when they were scheduled

    @property
    def live(self) -> list[Sequence]:
        """The sequences the engine still holds (a finished one is forgotten with its last delta)."""
        return list(self.core.sequences.values())

    @property
    def finished(self) -> list[Sequence]:
        return [seq for seq in self.added if seq.is_finished]

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> Sequence:
        request = check_request(prompt, SamplingParams(max_tokens=max_tokens), self.core.info)
        (sequence_id,) = self.core.add(request, request_id).child_ids
        seq = self.core.sequences[sequence_id]
        self.added.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        (delta,) = self.core.abort(seq.parent_id)
        assert delta.finish_reason == "abort" and delta.request_finished and seq.is_finished

    def checked(self, batch: ScheduledBatch, lookahead: bool) -> ScheduledBatch:
        seen = set()
        for index, seq in enumerate(batch.seqs):
            assert seq not in seen and seq.status is SequenceStatus.RUNNING
            seen.add(seq)
            # committed: the step's tokens count as computed, and fit the pages
            assert batch.positions[index] + batch.num_new_tokens[index] == seq.num_computed_tokens
            assert len(seq.pages) * self.pages.page_size >= seq.num_computed_tokens
            is_decode = index < batch.num_decode
            drafts = len(batch.drafts(index))
            assert (batch.num_new_tokens[index] == 1 + drafts) if is_decode else batch.num_new_tokens[index] >= 1
            # drafts need the last token: never with a pending one, never past max_tokens
            assert not drafts or (not lookahead and batch.positions[index] == seq.num_tokens - 1)
            assert len(seq.output_token_ids) + 1 + drafts <= seq.max_tokens
            # only a decode feeds on a pending token, and only on one the step before samples
            assert batch.positions[index] + batch.num_new_tokens[index] - drafts <= seq.num_tokens + is_decode
            self.fed_pending += batch.positions[index] == seq.num_tokens
        assert sum(batch.num_new_tokens) <= self.scheduler.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs
        if lookahead:
            assert not batch.preempted
        self.computed_tokens += sum(batch.num_new_tokens)
        return batch

    def step(self) -> None:
        if not self.in_flight:
            scheduled = self.core.schedule()
            assert scheduled is not None, "work remains but nothing was scheduled"
            self.in_flight.append(self.checked(scheduled[0], lookahead=False))
        if self.lookahead and len(self.in_flight) == 1:
            ahead = self.core.schedule_ahead(self.in_flight[0])
            if ahead is not None:
                self.in_flight.append(self.checked(ahead[0], lookahead=True))
        self.complete(self.in_flight.pop(0))
        self.check()

    def complete(self, batch: ScheduledBatch) -> None:
        """The step's samples come back: one per sampling row and draft, as the model gives them (also for a
        row whose sequence was aborted meanwhile), into `EngineCore.postprocess`."""
        token_ids = [next(self.next_token) for index, samples in enumerate(batch.samples) if samples
                     for _ in range(1 + len(batch.drafts(index)))]
        deltas = self.core.postprocess(batch, SamplerOutput(token_ids, [None] * len(token_ids)))
        for delta in deltas:
            if delta.finish_reason is not None:
                assert delta.finish_reason == "length" and delta.request_finished

    def check(self) -> None:
        self.core.check_integrity()

    def run(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.core.has_work():
                break
            self.step()
        assert not self.core.has_work(), "the workload did not finish"
        assert not self.core.sequences and not self.core.requests
        assert self.pages.tree.locked_pages == 0
        assert self.pages.pool.num_free + self.pages.tree.cached_pages == self.pages.num_pages


def test_common_prefix_length():
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length(list(range(1000)), list(range(999)) + [7]) == 999


@pytest.mark.parametrize("lookahead", [False, True])
def test_shared_prefix_arriving_together_is_computed_once(qwen_tokenizer, lookahead):
    engine = StepDriver(qwen_tokenizer, num_pages=64, page_size=4, budget=64, max_seqs=8, lookahead=lookahead)
    shared = list(range(40))
    for i in range(4):
        engine.add(f"r{i}", shared + [100 + i], max_tokens=3)
    engine.run()
    # one sequence computes the 40 shared tokens, the others only their uncached tails
    assert engine.computed_tokens <= 41 + 3 * (1 + 3) + 4 * 3
    assert engine.scheduler.prefix_cache_hits_total == 3 * 40


@pytest.mark.parametrize("lookahead", [False, True])
def test_hybrid_prompts_resume_from_state_snapshots(qwen_tokenizer, lookahead):
    engine = StepDriver(qwen_tokenizer, num_pages=64, page_size=4, budget=64, max_seqs=8, lookahead=lookahead,
                        snapshots=4)
    shared = list(range(40))
    for i in range(4):
        engine.add(f"r{i}", shared + [100 + i], max_tokens=3)
    engine.run()
    # the first saves its state at the shared prefix's end (its prompt's last page boundary); the others wait
    # one step for it, then restore it
    assert engine.scheduler.prefix_cache_hits_total == 3 * 40
    snapshots = engine.pages.snapshots.store
    assert snapshots.num_free + snapshots.num_attached == snapshots.num_snapshots
    engine.add("branch", shared[:20] + [7] * 30, max_tokens=2)  # branches off inside a node: no snapshot there
    first = engine.added[0]
    engine.add("turn2", first.token_ids + [5] * 9, max_tokens=5)  # its 43 tokens fed: the snapshot at 40
    engine.run()
    turn2 = engine.added[-1]
    engine.add("turn3", turn2.token_ids + [6], max_tokens=1)  # 53 prompt + 5 out - 1 = 57 fed: one at 56
    engine.run()
    assert [seq.num_cached_tokens for seq in engine.added[-3:]] == [0, 40, 56]


def test_a_hybrid_prompt_saves_its_end_only_where_that_spares_a_quarter_step(qwen_tokenizer):
    """A budget of 64 tokens: a prompt's end is saved (its chunk stopped at its last page boundary, its first token
    a step later) when it is cold, or 16 tokens or more past the prefix it found cached. A cold 41-token prompt
    stops at 40;
    the next turn, resuming from the reply's snapshot with 11 tokens to compute, samples in its first step (before,
    it stopped at 52 for a save sparing a repeat 8 tokens)."""
    engine = StepDriver(qwen_tokenizer, num_pages=64, page_size=4, budget=64, max_seqs=8, snapshots=4)
    first = engine.add("turn1", list(range(41)), max_tokens=6)
    engine.step()
    assert first.num_computed_tokens == 40 and not first.output_token_ids  # saved at 40, its last token next
    engine.run()
    second = engine.add("turn2", first.token_ids + [5] * 8, max_tokens=1)  # 41 + 6 - 1 = 46 fed: resumes at 44
    engine.step()
    assert second.num_cached_tokens == 44 and second.is_finished  # 11 tokens computed and its token sampled at once
    engine.run()


def test_lookahead_decodes_feed_on_pending_tokens_and_stop_at_max_tokens(qwen_tokenizer):
    engine = StepDriver(qwen_tokenizer, num_pages=64, page_size=4, budget=64, max_seqs=8, lookahead=True)
    for i in range(3):
        engine.add(f"r{i}", [i] * 5, max_tokens=6 + i)
    engine.run()
    assert engine.fed_pending > 0
    assert sorted(len(s.output_token_ids) for s in engine.finished) == [6, 7, 8]  # never a token past max_tokens
    assert all(s.num_pending_tokens == 0 for s in engine.finished)


@pytest.mark.parametrize("lookahead", [False, True])
def test_preemption_under_page_pressure_finishes_everything(qwen_tokenizer, lookahead):
    engine = StepDriver(qwen_tokenizer, num_pages=12, page_size=4, budget=32, max_seqs=8, lookahead=lookahead)
    for i in range(5):
        engine.add(f"r{i}", [i] * 10, max_tokens=30)
    engine.run()
    assert engine.scheduler.num_preemptions_total > 0
    assert all(len(s.output_token_ids) == 30 for s in engine.finished)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.integers(1, 4),
    extra_pages=st.integers(0, 12),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 5),
    caching=st.booleans(),
    lookahead=st.booleans(),
    speculative=st.sampled_from([0, 0, 1, 3]),
    snapshots=st.sampled_from([None, 0, 1, 3]),  # a hybrid model's state snapshots (None: not hybrid)
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.integers(1, 8), st.integers(0, 6),
                  st.booleans()),
        min_size=1,
        max_size=8,
    ),
)
def test_random_workloads_conserve_pages(qwen_tokenizer, page_size, extra_pages, budget, max_seqs, caching, lookahead,
                                        speculative, snapshots, requests):
    longest = max(len(p) + m for p, m, _, _ in requests)
    num_pages = -(-longest // page_size) + extra_pages
    engine = StepDriver(qwen_tokenizer, num_pages, page_size, budget, max_seqs, caching, lookahead, speculative,
                        snapshots if not speculative else None)
    pending = [(arrival, i, p, m, abort) for i, (p, m, arrival, abort) in enumerate(requests)]
    pending.sort(key=lambda item: (item[0], item[1]))
    step = 0
    while pending or engine.core.has_work():
        while pending and pending[0][0] <= step:
            _, i, prompt, max_tokens, abort_later = pending.pop(0)
            seq = engine.add(f"r{i}", prompt, max_tokens)
            if abort_later and step % 2 == 0:
                engine.abort(seq)  # aborted while still waiting
        if engine.core.has_work():
            engine.step()
            for seq in engine.live:
                if seq.params.max_tokens == 1 and seq.status is SequenceStatus.RUNNING and step % 3 == 0:
                    engine.abort(seq)  # aborted while running
                    engine.check()
        step += 1
        assert step < MAX_STEPS
    engine.run()


@pytest.mark.parametrize("caching", [False, True])
def test_drafts_roll_back_and_finish_at_max_tokens(qwen_tokenizer, caching):
    """Decodes verify drafts (some kept, some rolled back), under page pressure, and stop exactly at
    max_tokens; every page comes back."""
    engine = StepDriver(qwen_tokenizer, num_pages=14, page_size=4, budget=16, max_seqs=4, caching=caching,
                        speculative=3)
    for i in range(4):
        engine.add(f"r{i}", [0, 1, 2, 1, 1] * 2 + [i], max_tokens=17 + i)
    engine.run()
    stats = engine.core.stats()
    num_drafted, num_accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert num_accepted > 0 and num_drafted > num_accepted
    assert sorted(len(s.output_token_ids) for s in engine.finished) == [17, 18, 19, 20]
    assert all(s.num_pending_tokens == 0 for s in engine.finished)


def test_drafts_take_free_pages_only_and_fit_the_budget():
    pages = KVPageManager(num_pages=3, page_size=4, enable_prefix_caching=True)
    config = EngineConfig(page_size=4, num_pages=3, max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_config=SpeculativeConfig(8, prompt_lookup_min=1, prompt_lookup_max=1,
                                                                            disable_by_batch_size=None))
    scheduler = Scheduler(config, pages)
    seq = make_seq("r", [5, 6, 7, 5, 6, 7, 5], max_tokens=40)
    scheduler.add(seq)
    scheduler.schedule()  # the prompt: 7 tokens in 2 pages
    seq.append_token(6)
    batch = scheduler.schedule()  # drafts [7, 5, 6, 7, 5, 6, 7, 5] want 3 pages; 1 is free
    assert batch.draft_tokens == [[7, 5, 6, 7]] and batch.num_new_tokens == [5]
    assert len(seq.pages) == 3 and seq.num_computed_tokens == 12
    seq.settle_drafts(4, 1)
    assert seq.num_computed_tokens == 9 and seq.num_pending_tokens == 2
    for token in (7, 5):
        seq.append_token(token)

    small = Scheduler(EngineConfig(page_size=4, num_pages=8, max_num_seqs=8, max_num_batched_tokens=3,
                                   speculative_config=SpeculativeConfig(8, prompt_lookup_min=1, prompt_lookup_max=1,
                                                                        disable_by_batch_size=None)),
                      KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=True))
    seq = make_seq("s", [5, 6, 5], max_tokens=3)
    small.add(seq)
    small.schedule()
    seq.append_token(6)
    batch = small.schedule()  # budget 3 allows 2 drafts; max_tokens 3 leaves room for 1 (and its sample)
    assert batch.draft_tokens == [[5]]


def test_drafts_stop_above_disable_by_batch_size():
    """Above the batch size, steps decode without drafts and may be planned ahead again."""
    scheduler = speculative_scheduler(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=1,
                                                        disable_by_batch_size=1))
    first, second = make_seq("a", [5, 6, 5], max_tokens=9), make_seq("b", [7, 8, 7], max_tokens=9)
    scheduler.add(first)
    scheduler.schedule()
    first.append_token(6)
    alone = scheduler.schedule()  # one running sequence: drafts
    assert alone.draft_tokens == [[5, 6]] and not scheduler.can_plan_ahead(alone)
    first.settle_drafts(2, 0)
    first.append_token(1)
    scheduler.add(second)
    scheduler.schedule()  # first decodes (no drafts: two running now), second's prompt
    for seq, token in ((first, 2), (second, 8)):
        seq.append_token(token)
    both = scheduler.schedule()
    assert both.num_decode == 2 and both.draft_tokens == [[], []] and scheduler.can_plan_ahead(both)


def test_drafts_leave_every_running_sequence_its_token():
    """The older sequence's drafts could take the last free page, which the newer one's own token needs:
    drafts come after every running sequence's token, so nothing is preempted for a guess."""
    config = EngineConfig(page_size=4, num_pages=4, max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_config=SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=1,
                                                               disable_by_batch_size=None))
    scheduler = Scheduler(config, KVPageManager(num_pages=4, page_size=4, enable_prefix_caching=False))
    older, newer = make_seq("a", [5, 6, 5, 6, 5, 6, 5], max_tokens=9), make_seq("b", [9, 8, 7, 6], max_tokens=9)
    for seq in (older, newer):
        scheduler.add(seq)
    scheduler.schedule()  # both prompts: 2 pages + 1 page, 1 page free
    older.append_token(6)
    newer.append_token(1)
    batch = scheduler.schedule()  # newer's token needs the free page; older's drafts fit its own page
    assert not batch.preempted and batch.seqs == [older, newer]
    assert batch.draft_tokens == [[], []]


def test_a_request_switched_off_runs_no_model_proposer_and_its_steps_are_planned_ahead():
    """A model proposer (MTP) drafts in the runner for the step's sequences that the DraftSwitch still allows:
    once a request's drafts are mostly rejected, its steps run no proposer, and with none drafting the next
    step is planned ahead as without speculation. A new prompt beside it is drafted for, in a step planned
    ahead too, so that the proposer's caches cover its every token."""
    speculative = SpeculativeConfig(3, method="mtp", min_acceptance_rate=0.5, min_drafts_for_switch=3,
                                    disable_by_batch_size=None)
    scheduler = speculative_scheduler(speculative)
    first = make_seq("a", [5, 6, 5], max_tokens=20)
    scheduler.add(first)
    prompt = scheduler.schedule()
    assert prompt.proposes_for == [True] and prompt.run_proposer and not scheduler.can_plan_ahead(prompt)
    first.append_token(6)
    first.proposed_drafts = [1, 2, 3]
    verify = scheduler.schedule()
    assert verify.draft_tokens == [[1, 2, 3]] and verify.proposes_for == [True]
    first.settle_drafts(3, 0)  # none kept: 0 of 3 is below the switch's 50%
    scheduler.draft_switch.record(first, 3, 0)
    first.append_token(7)
    plain = scheduler.schedule()
    assert plain.draft_tokens == [[]] and plain.proposes_for == [False] and not plain.run_proposer
    assert scheduler.can_plan_ahead(plain)
    second = make_seq("b", [7, 8, 7], max_tokens=20)
    scheduler.add(second)
    ahead = scheduler.schedule(lookahead=True)
    assert ahead.seqs == [first, second] and ahead.proposes_for == [False, True]
    assert not scheduler.can_plan_ahead(ahead)
