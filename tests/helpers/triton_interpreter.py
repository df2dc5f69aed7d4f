"""Triton kernels under Triton's interpreter, from a test process that must stay uninterpreted.

Triton picks compiling or interpreting when it is imported, for the whole process, so the kernels run in another
process that has TRITON_INTERPRET=1 before it imports Triton; the test process's own environment stays as it is:
- `interpreter_pool`, for the `interpreter` fixture (tests/conftest.py): a spawned process whose initializer sets
  the variable and that runs the kernel calls submitted to it;
- `run_interpreted_cases`: a pytest session of its own over case files (not collected by the suite: no `test_`
  prefix), for cases that need fixtures, the model or the engine;
- `skip_repeated_language_patches`, which both call (the latter through tests/conftest.py): the interpreter without
  its repeated patching of triton.language at each helper call, the most of its time after the kernels' own work.
This module imports nothing heavy: the spawned process imports it to find the initializer.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from session_shared import SHARED_DIR_ENV, shared_directory

# the case files take a few minutes of CPU at most; a loaded 2-core machine stretches that
INTERPRETER_TIMEOUT_S = 900


def _interpret_triton() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    skip_repeated_language_patches()


def interpreter_pool() -> ProcessPoolExecutor:
    """One spawned worker process running Triton's interpreter; close it (a context manager) when done."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_interpret_triton)


def run_interpreted_cases(cases: list[Path], tmp_path_factory: pytest.TempPathFactory, *pytest_args: str) -> None:
    """Run the case files in a pytest subprocess with TRITON_INTERPRET=1 and assert that every case passed, none
    skipped. The subprocess reuses this session's built-once checkpoints (helpers/session_shared.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton")),
           SHARED_DIR_ENV: str(shared_directory(tmp_path_factory))}
    # a temporary folder in this session's, so that the subprocess creates (and cleans up after) no numbered
    # session folder of its own under the system's temporary directory; no Hypothesis there (its plugin imports
    # the library for the summary, ~1 s)
    basetemp = tmp_path_factory.mktemp("interpreted-session")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, cases), "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         f"--basetemp={basetemp}", "-W", "ignore::UserWarning", *pytest_args],
        cwd=cases[0].parents[2], env=env, capture_output=True, text=True, timeout=INTERPRETER_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def skip_repeated_language_patches() -> None:
    """Triton's interpreter patches triton.language (an `inspect.getmembers` walk over its modules) at each launch,
    and again at every call of a @triton.jit helper inside the kernel (`tl.sum` and the kernels' own helpers:
    triton/runtime/interpreter.py, `InterpretedFunction.__call__`), on every program of the grid; a helper call
    never undoes its patches, so from a helper's second call in a launch on, its walk changes nothing: those
    repeats were a fifth to a third of the interpreted cases' time. Here they are skipped; the launch's own
    patching and each helper's first call in a launch stay as Triton does them. Call it once in a process whose
    Triton interprets; a Triton without these internals is left as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton: the tests that need it skip
        return
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "GridExecutor")):
        return
    if getattr(interpreter._patch_lang, "skips_repeats", False):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()  # the launch running on this thread: its kernel and the helpers patched so far

    def patch_lang_once(fn):
        current = getattr(state, "launch", None)
        if current is None or fn is current.kernel:
            return patch_lang(fn)
        if fn in current.helpers:
            return None  # the walk would change nothing, and Triton's helper call discards what it returns
        current.helpers.add(fn)
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        state.launch = types.SimpleNamespace(kernel=self.fn, helpers=set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.launch = None

    patch_lang_once.skips_repeats = True
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once
