"""The compiled bf16 decode kernel against torch's matmul (skipped where the CPU cannot run it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import load_decode_linear_kernel
from mili_openai.kernels.linear import cpu_has_avx512_bf16

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernel():
    loaded = load_decode_linear_kernel()
    assert loaded is not None, "the CPU supports AVX512-BF16 but the kernel did not build"
    return loaded


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(64, 7), (1024, 4096), (96, 130)])
def test_matches_torch_linear(kernel, rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    got = kernel.linear(x, w)
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 accumulation then one bf16 rounding: within 1% of the magnitude
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_leading_dims_and_fallback(kernel):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    assert kernel.linear(x, w).shape == (2, 3, 16)
    many = torch.randn(20, 64, dtype=torch.bfloat16)  # beyond the kernel's rows: torch's path
    torch.testing.assert_close(kernel.linear(many, w), F.linear(many, w))
    fp32 = torch.randn(1, 64)
    torch.testing.assert_close(kernel.linear(fp32, w.float()), F.linear(fp32, w.float()))
