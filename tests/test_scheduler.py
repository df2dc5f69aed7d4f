"""The scheduler and page bookkeeping without a model: random workloads driven step by step.

A fake forward samples a token from a counter for each sequence whose step samples. After every step
the pages must be conserved (free + tree + owned == pool) and at the end everything must finish with
nothing locked. With `lookahead`, the engine plans each decode step's successor before the step's
tokens come back, as the async engine does.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mili_openai.config import EngineConfig
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.scheduler import ScheduledBatch, Scheduler, common_prefix_length
from mili_openai.engine.sequence import Sequence, SequenceStatus

MAX_STEPS = 2000


def make_seq(request_id: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        arrival_time=0.0,
        detokenizer=None,
        stop_matcher=None,
        generator=None,
    )


class FakeEngine:
    def __init__(self, num_pages: int, page_size: int, budget: int, max_seqs: int, caching: bool = True,
                 lookahead: bool = False) -> None:
        config = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_batched_tokens=budget,
                              max_num_seqs=max_seqs, enable_prefix_caching=caching)
        self.pages = KVPageManager(num_pages, page_size, caching)
        self.scheduler = Scheduler(config, self.pages)
        self.lookahead = lookahead
        self.live: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.next_token = itertools.count(1000)
        self.computed_tokens = 0
        self.in_flight: list[ScheduledBatch] = []  # scheduled, tokens not back yet (oldest first)
        self.fed_pending = 0  # decodes whose input token was still pending when they were scheduled

    def add(self, seq: Sequence) -> None:
        self.live[seq.request_id] = seq
        self.scheduler.add(seq)

    def schedule(self, lookahead: bool) -> ScheduledBatch | None:
        batch = self.scheduler.schedule(lookahead=lookahead)
        if batch is None:
            return None
        seen = set()
        for index, seq in enumerate(batch.seqs):
            assert seq not in seen and seq.status is SequenceStatus.RUNNING
            seen.add(seq)
            # committed: the step's tokens count as computed, and fit the pages
            assert batch.positions[index] + batch.num_new_tokens[index] == seq.num_computed_tokens
            assert len(seq.pages) * self.pages.page_size >= seq.num_computed_tokens
            is_decode = index < batch.num_decode
            assert (batch.num_new_tokens[index] == 1) if is_decode else batch.num_new_tokens[index] >= 1
            # only a decode feeds on a pending token, and only on one the step before samples
            assert batch.positions[index] + batch.num_new_tokens[index] <= seq.num_tokens + is_decode
            self.fed_pending += batch.positions[index] == seq.num_tokens
        assert sum(batch.num_new_tokens) <= self.scheduler.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs
        if lookahead:
            assert not batch.preempted
        self.computed_tokens += sum(batch.num_new_tokens)
        return batch

    def step(self) -> None:
        if not self.in_flight:
            batch = self.schedule(lookahead=False)
            assert batch is not None, "work remains but nothing was scheduled"
            self.in_flight.append(batch)
        running = self.in_flight[0]
        if self.lookahead and len(self.in_flight) == 1 and running.num_decode == len(running.seqs):
            ahead = self.schedule(lookahead=True)
            if ahead is not None:
                self.in_flight.append(ahead)
        self.complete(self.in_flight.pop(0))
        self.check()

    def complete(self, batch: ScheduledBatch) -> None:
        """The step's tokens come back (as EngineCore.postprocess handles them)."""
        for index, seq in enumerate(batch.seqs):
            if seq.is_finished:
                continue
            if index >= batch.num_decode:
                self.pages.cache_computed_pages(seq)
            if batch.samples[index]:
                seq.append_token(next(self.next_token))
                if len(seq.output_token_ids) >= seq.max_tokens:
                    self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        del self.live[seq.request_id]
        self.finished.append(seq)

    def check(self) -> None:
        self.pages.check_integrity(self.live.values())

    def run(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work(), "the workload did not finish"
        assert self.pages.tree.locked_pages == 0
        assert self.pages.pool.num_free + self.pages.tree.cached_pages == self.pages.num_pages


def test_common_prefix_length():
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length(list(range(1000)), list(range(999)) + [7]) == 999


@pytest.mark.parametrize("lookahead", [False, True])
def test_shared_prefix_arriving_together_is_computed_once(lookahead):
    engine = FakeEngine(num_pages=64, page_size=4, budget=64, max_seqs=8, lookahead=lookahead)
    shared = list(range(40))
    for i in range(4):
        engine.add(make_seq(f"r{i}", shared + [100 + i], max_tokens=3))
    engine.run()
    # one sequence computes the 40 shared tokens, the others only their uncached tails
    assert engine.computed_tokens <= 41 + 3 * (1 + 3) + 4 * 3
    assert engine.scheduler.prefix_cache_hits_total == 3 * 40


def test_lookahead_decodes_feed_on_pending_tokens_and_stop_at_max_tokens():
    engine = FakeEngine(num_pages=64, page_size=4, budget=64, max_seqs=8, lookahead=True)
    for i in range(3):
        engine.add(make_seq(f"r{i}", [i] * 5, max_tokens=6 + i))
    engine.run()
    assert engine.fed_pending > 0
    assert sorted(len(s.output_token_ids) for s in engine.finished) == [6, 7, 8]  # never a token past max_tokens
    assert all(s.num_pending_tokens == 0 for s in engine.finished)


@pytest.mark.parametrize("lookahead", [False, True])
def test_preemption_under_page_pressure_finishes_everything(lookahead):
    engine = FakeEngine(num_pages=12, page_size=4, budget=32, max_seqs=8, lookahead=lookahead)
    for i in range(5):
        engine.add(make_seq(f"r{i}", [i] * 10, max_tokens=30))
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
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.integers(1, 8), st.integers(0, 6),
                  st.booleans()),
        min_size=1,
        max_size=8,
    ),
)
def test_random_workloads_conserve_pages(page_size, extra_pages, budget, max_seqs, caching, lookahead, requests):
    longest = max(len(p) + m for p, m, _, _ in requests)
    num_pages = -(-longest // page_size) + extra_pages
    engine = FakeEngine(num_pages, page_size, budget, max_seqs, caching, lookahead)
    pending = [(arrival, i, make_seq(f"r{i}", p, m), abort) for i, (p, m, arrival, abort) in enumerate(requests)]
    pending.sort(key=lambda item: (item[0], item[1]))
    step = 0
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            _, _, seq, abort_later = pending.pop(0)
            engine.add(seq)
            if abort_later and step % 2 == 0:
                engine.finish(seq, "abort")  # aborted while still waiting
        if engine.scheduler.has_work():
            engine.step()
            for seq in list(engine.live.values()):
                if seq.params.max_tokens == 1 and seq.status is SequenceStatus.RUNNING and step % 3 == 0:
                    engine.finish(seq, "abort")  # aborted while running
                    engine.check()
        step += 1
        assert step < MAX_STEPS
    engine.run()
