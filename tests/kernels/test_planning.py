"""The load-time plan's timing rules, on stand-in work with known costs and a fake clock: no compiled kernel,
and nothing here depends on how fast or how busy the machine is."""

from __future__ import annotations

import itertools

import pytest
import torch

from mili_openai.kernels.planning import (
    DECODE_PREFETCH_CHOICES,
    KERNEL_ROWS_CHOICES,
    fastest_seconds,
    median_time_ratio,
    plan_decode_prefetch,
    plan_matmuls,
    plan_prefill_attention,
)


class FakeClock:
    """A clock that moves only when stand-in work says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, seconds: float):
        """A stand-in that takes `seconds`, whatever it is called with."""
        def run(*args) -> None:
            self.now += seconds
        return run


BURST_SPEEDUP = 10  # a burst call costs a tenth of its stand-in's ticks


def work_on_a_bursty_machine(clock: FakeClock, costs: dict[str, int], burst_calls: set[int]):
    """Stand-ins advancing the fake clock by their `costs` in whole ticks, a tenth of it on the calls numbered
    in `burst_calls` (a VM whose memory briefly runs fast), counting calls across all of them."""
    calls = itertools.count()

    def make(name: str):
        def run() -> None:
            clock.now += costs[name] // BURST_SPEEDUP if next(calls) in burst_calls else costs[name]
        return run

    return make("cheap"), make("dear")


def test_interleaved_rounds_see_through_a_burst():
    """The dear candidate (1.5x the cheap one's time) meets a fast burst in one of its runs: the fastest of
    a few runs of each then picks it, the median of interleaved rounds still sees its real cost."""
    clock, costs = FakeClock(), {"cheap": 40, "dear": 60}  # whole ticks of the fake clock
    # calls: cheap's warm-up and 3 runs are 0-3, dear's warm-up is 4, its first timed run 5
    cheap, dear = work_on_a_bursty_machine(clock, costs, burst_calls={5})
    # The fastest-of-runs rule the plan used before keeps one call of each stand-in: cheap's own cost, and dear's
    # burst call (a tenth of its cost), so it is misled into ranking dear first.
    kept = {name: fastest_seconds(run, clock=clock) for name, run in (("cheap", cheap), ("dear", dear))}
    assert kept == {"cheap": costs["cheap"], "dear": costs["dear"] // BURST_SPEEDUP}
    assert min(kept, key=kept.get) == "dear"

    # dear's timed run in the first round of each comparison (the first takes calls 0-19, 2 warm-ups + 9 x 2)
    cheap, dear = work_on_a_bursty_machine(clock, costs, burst_calls={3, 22})
    assert median_time_ratio(cheap, dear, clock=clock) == pytest.approx(40 / 60)
    assert median_time_ratio(dear, cheap, clock=clock) == pytest.approx(60 / 40)  # the burst's round: 6 / 40


def test_the_untimed_step_runs_before_each_run():
    """`before` runs ahead of every timed run (not the warm-ups), and its time is not counted."""
    clock, befores = FakeClock(), []

    def before() -> None:
        befores.append(1)
        clock.now += 10.0

    ratio = median_time_ratio(clock.costing(2.0), clock.costing(4.0), rounds=3, before=before, clock=clock)
    assert len(befores) == 2 * 3
    assert ratio == pytest.approx(0.5)  # with the 10 counted it would be 12 / 14


def test_plans_pick_whichever_is_faster():
    """The load-time plans follow the timings: a kernel faster than torch at every size takes every row
    count and every dtype; one slower than torch takes only the decode batches it always takes (up to 8
    rows) and no prefill attention; the prefetch distance is the fastest one's."""
    clock = FakeClock()
    gemms = (clock.costing(2.0), clock.costing(3.0))  # the fp32 GEMM, then the bf16 one
    max_rows, large_matmul = plan_matmuls(clock.costing(1.0), clock, gemms)
    assert max_rows == KERNEL_ROWS_CHOICES[-1] and large_matmul is gemms[0]
    max_rows, large_matmul = plan_matmuls(clock.costing(5.0), clock, gemms[::-1])
    # the faster GEMM by FakeClock's fixed costs (first or not), not by a measured time
    assert max_rows == KERNEL_ROWS_CHOICES[0] and large_matmul is gemms[0]
    dtypes = (torch.bfloat16, torch.float32)
    sdpa = clock.costing(2.0)
    assert plan_prefill_attention(clock.costing(1.0), dtypes, clock, sdpa) == frozenset(dtypes)
    assert plan_prefill_attention(clock.costing(5.0), dtypes, clock, sdpa) == frozenset()
    for fastest in DECODE_PREFETCH_CHOICES:

        def decode(*args, fastest=fastest) -> None:
            clock.now += 1.0 if args[-1] == fastest else 1.5  # the last argument: the prefetch distance

        assert plan_decode_prefetch(decode, clock, evict_bytes=0) == fastest
