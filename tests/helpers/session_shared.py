"""Session fixtures built once for all of a session's pytest-xdist workers, not once per worker.

Each worker is a process of its own with its own session fixtures: under the README's `-n 2` every checkpoint
would be built twice. `built_once(tmp_path_factory, name, build)` runs `build(directory)` in whichever worker asks
first, under a file lock in the directory the session's workers share (pytest-xdist's documented pattern:
`tmp_path_factory.getbasetemp().parent` and filelock); the others wait for it and reuse what it wrote. Without
xdist it builds in the session's own temporary directory. What is built must be read-only to the tests (a test
that changes a checkpoint copies it first, as they do).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

SHARED_DIR_NAME = "built-once"
# beside each built directory, written last, holding what `build` returned: a directory without one is unfinished
BUILT_SUFFIX = ".built"
# set by a test that runs pytest in a subprocess (the Triton interpreter's cases): that session builds into, and
# reuses, its parent session's directory
SHARED_DIR_ENV = "MILI_TESTS_BUILT_ONCE_DIR"


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this test session's built-once results live (created)."""
    if os.environ.get(SHARED_DIR_ENV):
        shared = Path(os.environ[SHARED_DIR_ENV])
    elif os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is a folder of the session's
        shared = tmp_path_factory.getbasetemp().parent / SHARED_DIR_NAME
    else:
        shared = tmp_path_factory.getbasetemp() / SHARED_DIR_NAME
    shared.mkdir(exist_ok=True)
    return shared


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(directory)`'s result (a path), built once per test session; `name` must be unique in it."""
    shared = shared_directory(tmp_path_factory)
    directory, mark = shared / name, shared / f"{name}{BUILT_SUFFIX}"
    with FileLock(str(shared / f"{name}.lock")):
        if not mark.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that failed part-way
            directory.mkdir()
            mark.write_text(str(build(directory)))
    return Path(mark.read_text())
