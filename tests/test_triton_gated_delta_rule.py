"""The Triton gated delta rule and causal conv without a GPU: tests/triton_linear_attention_cases.py run in a
subprocess with TRITON_INTERPRET=1 (Triton reads the variable when it is imported and keeps it for the process;
this one must stay uninterpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("triton_linear_attention_cases.py")
INTERPRETER_TIMEOUT_S = 900  # the cases take well under a minute of CPU; a loaded 2-core machine stretches that


def test_kernels_match_the_reference_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning"],
        cwd=CASES.parent.parent, env=env, capture_output=True, text=True, timeout=INTERPRETER_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
