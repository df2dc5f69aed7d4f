"""Triton kernels under Triton's interpreter, from a test process that must stay uninterpreted.

Triton picks compiling or interpreting when it is imported, for the whole process, so the kernels run in another
process that has TRITON_INTERPRET=1 before it imports Triton; the test process's own environment stays as it is:
- `interpreter_pool`, for the `interpreter` fixture (tests/conftest.py): a spawned process whose initializer sets
  the variable and that runs the kernel calls submitted to it;
- `run_interpreted_cases`: a pytest session of its own over case files (not collected by the suite: no `test_`
  prefix), for cases that need fixtures, the model or the engine.
This module imports nothing heavy: the spawned process imports it to find the initializer.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from session_shared import SHARED_DIR_ENV, shared_directory

# the case files take a few minutes of CPU at most; a loaded 2-core machine stretches that
INTERPRETER_TIMEOUT_S = 900


def _interpret_triton() -> None:
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_pool() -> ProcessPoolExecutor:
    """One spawned worker process running Triton's interpreter; close it (a context manager) when done."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_interpret_triton)


def run_interpreted_cases(cases: list[Path], tmp_path_factory: pytest.TempPathFactory, *pytest_args: str) -> None:
    """Run the case files in a pytest subprocess with TRITON_INTERPRET=1 and assert that every case passed, none
    skipped. The subprocess reuses this session's built-once checkpoints (helpers/session_shared.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton")),
           SHARED_DIR_ENV: str(shared_directory(tmp_path_factory))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, cases), "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
         *pytest_args],
        cwd=cases[0].parents[2], env=env, capture_output=True, text=True, timeout=INTERPRETER_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
