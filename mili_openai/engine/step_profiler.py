"""A torch profile of the engine's steps while it serves, started and stopped on request (`POST /start_profile`,
`POST /stop_profile` with `--torch-profiler-dir`, as vLLM's routes and its torch profiler directory).

The profiler starts on the engine's loop thread and records every thread's torch ops
(`profile_all_threads`): the loop prepares and, under async launch, launches the steps, and the forward
runs on the engine's worker thread. On CUDA it records the GPU's kernels too. Stopping writes two files into
the directory: a gzipped Chrome trace (open it in https://ui.perfetto.dev) and a text summary, the operator
tables by device time and by host time, with the steps recorded and, on CUDA, the share of the wall time
the GPU was busy. Writing runs on a thread of its own, so the engine keeps stepping meanwhile. In the trace,
each step's work sits in a named range: `mili::execute` (forward and sampling on the worker thread), or under
async launch `mili::launch` (on the loop thread) and `mili::finish` (the worker's wait), then
`mili::postprocess` on the loop thread.

Tensor-parallel workers run in processes of their own: only the engine's process is profiled.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, record_function

from mili_openai.engine.outputs import ProfileFiles, ProfilerStateError

TOP_OPERATORS = 25  # rows of each operator table in the summary
DEVICE_TIME_KEY = "self_device_time_total"
HOST_TIME_KEY = "self_cpu_time_total"


@dataclass(frozen=True, slots=True)
class StoppedProfile:
    """A stopped profile not written yet: `write` (seconds of work on large traces) runs off the engine loop."""

    profiler: profile
    trace_path: Path
    summary_path: Path
    num_steps: int
    wall_s: float
    on_cuda: bool

    def write(self) -> ProfileFiles:
        self.profiler.export_chrome_trace(str(self.trace_path))  # a ".gz" name is written gzipped
        events = self.profiler.key_averages()
        busy = None
        if self.on_cuda and self.wall_s > 0:
            busy = sum(event.self_device_time_total for event in events) / 1e6 / self.wall_s
        lines = [f"engine steps recorded: {self.num_steps}", f"wall time: {self.wall_s:.3f} s"]
        if busy is not None:
            lines.append(f"GPU busy: {100 * busy:.1f}% of the wall time (kernel time summed over streams)")
        if self.on_cuda:
            lines += ["", "## operators by device time",
                      events.table(sort_by=DEVICE_TIME_KEY, row_limit=TOP_OPERATORS)]
        lines += ["", "## operators by host time", events.table(sort_by=HOST_TIME_KEY, row_limit=TOP_OPERATORS)]
        self.summary_path.write_text("\n".join(lines) + "\n")
        return ProfileFiles(str(self.trace_path), str(self.summary_path), self.num_steps, self.wall_s, busy)


def _in_range(work: Callable, label: str) -> Callable:
    def recorded(*args):
        with record_function(label):
            return work(*args)
    return recorded


class StepProfiler:
    """One profile at a time, of the engine this belongs to; files named by start time, pid and a count."""

    def __init__(self, out_dir: str | Path, device: torch.device) -> None:
        self.out_dir = Path(out_dir).resolve()
        self.on_cuda = device.type == "cuda"
        self._profiler: profile | None = None
        self._started = 0.0
        self._stamp = ""
        self._num_steps = 0
        self._count = itertools.count()

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self._profiler is not None:
            raise ProfilerStateError("a profile is already running: POST /stop_profile first")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        profiler = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
        profiler.start()
        self._profiler, self._num_steps, self._started = profiler, 0, time.perf_counter()
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self._stamp = f"mili-{stamp}-pid{os.getpid()}-{next(self._count)}"

    def recorded(self, work: Callable, what: str) -> Callable:
        """`work` inside a range named `mili::<what>` while a profile runs; `work` itself otherwise."""
        return work if self._profiler is None else _in_range(work, f"mili::{what}")

    def on_step(self) -> None:
        """An engine step finished (counted while a profile runs)."""
        if self._profiler is not None:
            self._num_steps += 1

    def stop(self) -> StoppedProfile:
        profiler = self._profiler
        if profiler is None:
            raise ProfilerStateError("no profile is running: POST /start_profile first")
        if self.on_cuda:
            torch.cuda.synchronize()  # the steps launched so far finish inside the profile and its wall time
        profiler.stop()
        self._profiler = None
        return StoppedProfile(profiler, self.out_dir / f"{self._stamp}.pt.trace.json.gz",
                              self.out_dir / f"{self._stamp}.summary.txt", self._num_steps,
                              time.perf_counter() - self._started, self.on_cuda)

    def discard(self) -> None:
        """Stop a running profile without writing it (the engine shuts down)."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
