"""The kernel plan kept on disk (kernels/plan_cache.py): a plan is timed once per key and read back after, with a
timer the tests inject (a stand-in that counts its calls), so nothing here times anything or depends on the
machine; and `load_cpu_kernels`'s switch between the cache and timing, on a stand-in for the compiled kernels."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu as cpu_kernels
from mili_openai.kernels.plan_cache import (
    KernelPlanCache,
    cpu_identity,
    plan_from_json,
    plan_key,
    plan_to_json,
)
from mili_openai.kernels.planning import KernelPlan, linear_via_fp32

TIMED = KernelPlan(max_kernel_rows=16, large_matmul=linear_via_fp32,
                   prefill_attention_dtypes=frozenset({torch.bfloat16}), decode_prefetch_blocks=1)
OTHER = KernelPlan(max_kernel_rows=64, large_matmul=F.linear, prefill_attention_dtypes=frozenset(),
                   decode_prefetch_blocks=3)


class CountingTimer:
    """Stands in for timing a plan: returns `plan` and counts its calls."""

    def __init__(self, plan: KernelPlan = TIMED) -> None:
        self.plan, self.calls = plan, 0

    def __call__(self) -> KernelPlan:
        self.calls += 1
        return self.plan


def key(**changes: str) -> dict[str, str]:
    return {**plan_key("mili_cpu_kernels_0123456789ab", threads=1, cpu="Test CPU | avx512f"), **changes}


@pytest.mark.parametrize("plan", [TIMED, OTHER, KernelPlan()])
def test_a_plan_reads_back_as_it_was_written(plan):
    assert plan_from_json(json.loads(json.dumps(plan_to_json(plan)))) == plan


def test_the_first_start_times_and_keeps_the_plan_and_the_next_reads_it(tmp_path):
    cache, timer = KernelPlanCache(tmp_path / "plans"), CountingTimer()
    assert cache.read_or_time(key(), timer) == TIMED and timer.calls == 1
    later = CountingTimer(OTHER)  # a later start (another process): reads the kept plan, times nothing
    assert KernelPlanCache(tmp_path / "plans").read_or_time(key(), later) == TIMED and later.calls == 0


@pytest.mark.parametrize("field", ["cpu", "torch", "threads", "build", "planner"])
def test_a_plan_is_timed_again_for_another_machine_build_or_planner(tmp_path, field):
    cache = KernelPlanCache(tmp_path)
    cache.read_or_time(key(), CountingTimer())
    other = CountingTimer(OTHER)
    assert cache.read_or_time(key(**{field: "something else"}), other) == OTHER and other.calls == 1
    assert cache.read_or_time(key(), CountingTimer(OTHER)) == TIMED  # each key keeps its own plan


@pytest.mark.parametrize("damage", [
    lambda path: path.write_text("{not json"),
    lambda path: path.write_text(json.dumps({"key": key(), "plan": {"max_kernel_rows": 12}})),
    lambda path: path.write_text(json.dumps({"key": key(), "plan": {**plan_to_json(TIMED), "max_kernel_rows": 12}})),
    lambda path: path.write_text(json.dumps({"key": key(), "plan": {**plan_to_json(TIMED), "large_matmul": "mm"}})),
    lambda path: path.write_text(json.dumps({"key": key(cpu="another"), "plan": plan_to_json(TIMED)})),
], ids=["not-json", "fields-missing", "a-choice-not-made", "an-unknown-gemm", "another-key"])
def test_a_file_that_is_not_a_plan_for_the_key_is_timed_again_and_written_over(tmp_path, damage):
    cache = KernelPlanCache(tmp_path)
    cache.read_or_time(key(), CountingTimer())
    damage(cache.path(key()))
    timer = CountingTimer(OTHER)
    assert cache.read_or_time(key(), timer) == OTHER and timer.calls == 1
    assert cache.read(key()) == OTHER


def test_a_directory_that_cannot_be_written_still_gives_the_timed_plan(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache, timer = KernelPlanCache(blocker / "plans"), CountingTimer()  # under a file: cannot be made
    assert cache.read_or_time(key(), timer) == TIMED and timer.calls == 1
    assert cache.read_or_time(key(), timer) == TIMED and timer.calls == 2  # nothing kept: timed again


def test_starts_racing_each_other_time_the_plan_once(tmp_path):
    cache, entered, release = KernelPlanCache(tmp_path), threading.Event(), threading.Event()
    timer, results = CountingTimer(), []

    def slow_timer() -> KernelPlan:  # holds the lock until the second start is waiting on it
        entered.set()
        assert release.wait(timeout=60)
        return timer()

    first = threading.Thread(target=lambda: results.append(cache.read_or_time(key(), slow_timer)))
    first.start()
    assert entered.wait(timeout=60)
    second = threading.Thread(target=lambda: results.append(KernelPlanCache(tmp_path).read_or_time(key(), timer)))
    second.start()
    release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert results == [TIMED, TIMED] and timer.calls == 1


def test_the_cpu_is_named_by_its_model_and_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx512f\n\n"
                       "processor\t: 1\nmodel name\t: Test CPU\nflags\t\t: fpu avx512f\n")
    assert cpu_identity(cpuinfo) == "Test CPU | fpu avx512f"
    assert cpu_identity(tmp_path / "missing") == ""


class StandInKernels:
    """What `load_cpu_kernels` asks of the compiled kernels' object, with an injected timer."""

    amx_tiles = False
    max_kernel_rows = TIMED.max_kernel_rows

    def __init__(self) -> None:
        self.plan, self.planned, self.timed_plan = KernelPlan(), False, CountingTimer()


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    kernels = StandInKernels()
    monkeypatch.setattr(cpu_kernels, "_compiled_kernels", lambda: kernels)
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda name, source_dir: tmp_path / name)
    return kernels


@pytest.mark.parametrize("plan_cache", [True, False])
def test_load_cpu_kernels_plans_once_per_process_from_the_cache_or_by_timing(stand_in, tmp_path, plan_cache):
    assert cpu_kernels.load_cpu_kernels(plan_cache) is stand_in and stand_in.plan == TIMED
    assert cpu_kernels.load_cpu_kernels(plan_cache) is stand_in and stand_in.timed_plan.calls == 1
    kept = list(tmp_path.glob("*/kernel-plans/plan-*.json"))
    assert len(kept) == (1 if plan_cache else 0)


def test_a_second_process_reads_the_plan_the_first_kept(stand_in):
    cpu_kernels.load_cpu_kernels(True)
    stand_in.planned, stand_in.plan, stand_in.timed_plan = False, KernelPlan(), CountingTimer(OTHER)  # restarted
    assert cpu_kernels.load_cpu_kernels(True).plan == TIMED and stand_in.timed_plan.calls == 0
    stand_in.planned = False  # with the cache off, it times its own
    assert cpu_kernels.load_cpu_kernels(False).plan == OTHER and stand_in.timed_plan.calls == 1
