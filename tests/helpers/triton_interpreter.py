"""A process that runs Triton kernels under Triton's interpreter, for the `interpreter` fixture (tests/conftest.py).

Triton picks compiling or interpreting when it is imported, for the whole process, so the kernel calls run in a
spawned process whose initializer sets TRITON_INTERPRET=1 before any task imports Triton; the test process's own
environment stays as it is. This module imports nothing heavy: the spawned process imports it to find the
initializer.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor


def _interpret_triton() -> None:
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_pool() -> ProcessPoolExecutor:
    """One spawned worker process running Triton's interpreter; close it (a context manager) when done."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_interpret_triton)
