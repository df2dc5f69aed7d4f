"""The soak command (scripts/soak.py) at a reduced size; `slow`: run with `pytest -m slow`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SOAK_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
SMALL_SOAK = ["--requests", "36", "--burst", "16", "--long-prompt-tokens", "2000", "--max-model-len", "4096",
              "--num-pages", "1024", "--deadline-s", "900"]  # 900: a first start builds the kernels


@pytest.mark.slow
def test_small_soak_passes(capsys):
    spec = importlib.util.spec_from_file_location("soak", SOAK_SCRIPT)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    assert soak.main(SMALL_SOAK) == 0, capsys.readouterr().out
