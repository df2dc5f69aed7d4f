"""The Triton kernels without a GPU, under Triton's CPU interpreter, with the model and the engine around them:
the case files run in one pytest subprocess with TRITON_INTERPRET=1, because Triton reads that variable when it is
imported and keeps it for the process (this one must stay uninterpreted). One subprocess for all of them: each
start imports torch, Triton, transformers and the engine anew (helpers/triton_interpreter.py).

- tests/kernels/triton_attention_cases.py: the paged attention kernels against their torch reference, and the
  engine on them against transformers;
- tests/kernels/triton_compile_cases.py: no compile under load (every serving launch is a warmed-up variant);
- tests/kernels/triton_linear_attention_cases.py: the gated delta rule and causal conv against their reference
  (its engine case is marked slow: run that file directly for it).

The kernels compiled for Hopper (no GPU needed): tests/kernels/test_triton_attention.py and
tests/kernels/test_triton_gated_delta_rule.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_interpreter import run_interpreted_cases

pytest.importorskip("triton")

CASES = [Path(__file__).with_name(name)
         for name in ("triton_attention_cases.py", "triton_compile_cases.py", "triton_linear_attention_cases.py")]


def test_kernels_match_their_reference_under_the_interpreter(tmp_path_factory):
    run_interpreted_cases(CASES, tmp_path_factory, "-m", "not slow")
