"""Shared by the deployment tests: the repository root and the offline tools of the `test` extra."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        pytest.skip(f"{name} is not installed; `pip install -e '.[test]'` provides it")
    return found
