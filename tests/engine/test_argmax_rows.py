"""The sampler's argmax against torch.argmax: ties, NaN and infinities included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mili_openai.engine.logits_processing import argmax_rows

# few distinct values, so rows are full of ties; NaN and both infinities among them
VALUES = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda rows: st.lists(st.lists(VALUES, min_size=9, max_size=9),
                                                      min_size=rows, max_size=rows)))
def test_argmax_rows_matches_torch_argmax(rows):
    x = torch.tensor(rows, dtype=torch.float32)
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_reads_strided_rows_and_other_dtypes():
    x = torch.randn(6, 151936, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(x[::2]), x[::2].argmax(dim=-1))  # a row subset, as the sampler takes
    # bf16 goes through torch's argmax; its values widen to float32 exactly, so the numpy path must agree
    half = x.to(torch.bfloat16)
    assert torch.equal(argmax_rows(half), argmax_rows(half.float()))
