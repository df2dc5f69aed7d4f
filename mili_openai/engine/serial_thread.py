"""Keeps the event loop thread's own torch ops on that thread, so the forward's OpenMP team stays fast.

The loop thread runs a few torch ops per step (batch metadata, rotary cos/sin). Above ATen's grain size
(32768 elements: a 512-token chunk's rotary, a large decode batch's slot table) such an op runs in
parallel, and OpenMP gives the loop thread a team of its own. libgomp then manages more threads than
there are cores, and from that moment cuts the spinning at every barrier of every team to ~100 turns:
the forward's two threads sleep and wake at each of the hundreds of parallel regions in a step, which
slows every decode step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from threadpoolctl import threadpool_limits


@contextlib.contextmanager
def serial_torch_ops() -> Iterator[None]:
    """Torch ops on the calling thread run on it alone while inside; other threads keep their teams.

    OpenMP's thread count is per thread (`omp_set_num_threads` sets the calling thread's), which is
    what threadpoolctl sets for "openmp"; BLAS pools, which are process-wide, are left alone.
    """
    # torch sets a thread's OpenMP count on that thread's first parallel-capable op: let it happen
    # now, or it would later undo the limit below
    torch.get_num_threads()
    with threadpool_limits(limits=1, user_api="openmp"):
        yield
