"""The compiled zero-centred RMSNorm (csrc/zero_centered_norm.cpp) against model/hybrid_norms.py's torch ops."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.model.hybrid_norms import ZeroCenteredRMSNorm
from mili_openai.model.kernel_backend import KernelBackend

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")

DIM = 48  # three registers
EPS = 1e-6
# fp32: the sum of squares in another order; bf16: that, at most one rounding step apart
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def norms(kernels, dtype: torch.dtype) -> tuple[ZeroCenteredRMSNorm, ZeroCenteredRMSNorm]:
    """(torch's, the kernel's) over the same weight."""
    reference = ZeroCenteredRMSNorm(DIM, EPS, KernelBackend())
    with torch.no_grad():
        reference.weight.copy_(0.3 * torch.randn(DIM, generator=torch.Generator().manual_seed(0)))
    reference = reference.to(dtype)
    fused = ZeroCenteredRMSNorm(DIM, EPS, KernelBackend(zero_centered_norm=kernels)).to(dtype)
    fused.load_state_dict(reference.state_dict())
    return reference, fused


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_matches_torch(kernels, dtype):
    reference, fused = norms(kernels, dtype)
    x = randn(5, DIM, dtype=dtype, seed=1)
    torch.testing.assert_close(fused(x), reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_then_norm_matches_torch(kernels, dtype):
    """The sum is written over x exactly as torch's add_ rounds it, and the norm taken of it."""
    reference, fused = norms(kernels, dtype)
    x, residual = randn(3, DIM, dtype=dtype, seed=2), randn(3, DIM, dtype=dtype, seed=3)
    want_hidden, want = reference.add_and_norm(x.clone(), residual)
    got_hidden, got = fused.add_and_norm(x, residual)
    assert got_hidden.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_heads_of_a_wider_row(kernels):
    """q heads as attention views them: (T, H, D) rows 2D apart in the projection's output (q, then its gate)."""
    reference, fused = norms(kernels, torch.bfloat16)
    q = randn(4, 3, 2 * DIM, dtype=torch.bfloat16, seed=4)[..., :DIM]
    assert not q.is_contiguous()
    torch.testing.assert_close(fused(q), reference(q), **TOLERANCE[torch.bfloat16])


def test_rows_outside_the_kernel_run_torch(kernels):
    """D = 8 is no whole register: the kernel declines and the torch ops run."""
    reference = ZeroCenteredRMSNorm(8, EPS, KernelBackend())
    fused = ZeroCenteredRMSNorm(8, EPS, KernelBackend(zero_centered_norm=kernels))
    x = randn(2, 8, dtype=torch.float32, seed=5)
    assert kernels.zero_centered_rms_norm(x, reference.weight, EPS, None) is None
    torch.testing.assert_close(fused(x), reference(x))
