"""The load-time plan's timing rule, on stand-in work with known costs (no compiled kernel needed)."""

from __future__ import annotations

import itertools
import time

from mili_openai.kernels.planning import fastest_seconds, median_time_ratio


def work_on_a_bursty_machine(costs: dict[str, float], burst_calls: set[int]):
    """Stand-ins that sleep their cost, a tenth of it on the machine's calls numbered in `burst_calls` (a VM
    whose memory briefly runs fast), counting calls across all of them."""
    calls = itertools.count()

    def make(name: str):
        def run() -> None:
            factor = 0.1 if next(calls) in burst_calls else 1.0
            time.sleep(costs[name] * factor)
        return run

    return make("cheap"), make("dear")


def test_interleaved_rounds_see_through_a_burst():
    """The dear candidate (1.5x the cheap one's time) meets a fast burst in one of its runs: the fastest of
    a few runs of each then picks it, the median of interleaved rounds still sees its real cost."""
    costs = {"cheap": 0.004, "dear": 0.006}
    # calls: cheap's warm-up and 3 runs are 0-3, dear's warm-up is 4, its first timed run 5
    cheap, dear = work_on_a_bursty_machine(costs, burst_calls={5})
    cheap_seconds = fastest_seconds(cheap)
    assert fastest_seconds(dear) < cheap_seconds  # the rule the plan used before: misled

    # dear's timed run in the first round of each comparison (the first takes calls 0-19, 2 warm-ups + 9 x 2)
    cheap, dear = work_on_a_bursty_machine(costs, burst_calls={3, 22})
    ratio = median_time_ratio(cheap, dear)
    assert 0.55 < ratio < 0.8  # 4 / 6 ms, with sleep's overshoot
    assert median_time_ratio(dear, cheap) > 1.0  # the burst's round alone says 0.1


def test_the_untimed_step_runs_before_each_run():
    """`before` runs ahead of every timed run (not the warm-ups), and its time is not counted."""
    befores = []
    ratio = median_time_ratio(lambda: time.sleep(0.002), lambda: time.sleep(0.004), rounds=3,
                              before=lambda: (befores.append(1), time.sleep(0.01)))
    assert len(befores) == 2 * 3
    assert 0.35 < ratio < 0.7  # 2 / 4 ms; with the 10 ms counted it would be 12 / 14
