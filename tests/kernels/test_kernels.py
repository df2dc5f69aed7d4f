"""The compiled CPU kernels against torch (skipped where the CPU cannot run them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.planning import KERNEL_ROWS_CHOICES, KernelPlan, linear_via_fp32
from mili_openai.model.layers import rms_normalize
from mili_openai.model.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")


def product_kinds(kernels) -> list[bool]:
    """Whether to multiply bf16 pairs: never (widened fp32), and also where the CPU has them (AVX512-BF16)."""
    return [False, True] if kernels.bf16_dot_products else [False]


def matmul_kinds(kernels) -> list[tuple[bool, bool]]:
    """(bf16 pairs, AMX tiles) for linear_bf16: each product kind, and AMX tiles where the CPU has them."""
    return [(pairs, False) for pairs in product_kinds(kernels)] + ([(True, True)] if kernels.amx_tiles else [])


# K: one vector, an odd multiple of 16 (the bf16-pair tail), the model's widths
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16, 64])
@pytest.mark.parametrize("k,n", [(16, 7), (1024, 4096), (96, 130), (3072, 9), (48, 33), (64, 96)])
def test_linear_kernel_matches_fp32_matmul(kernels, rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    want = F.linear(x.float(), w.float())
    for kind in matmul_kinds(kernels):
        got = kernels._module.linear_bf16(x, w, *kind)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # fp32 accumulation then one bf16 rounding: within 1% of the magnitude
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("n", [7, 24, 49, 96, 1000, 1024])
def test_linear_kernel_covers_every_weight_row_whatever_the_threads(kernels, threads, n):
    """Threads own ranges of weight rows and steal from each other's backs: every output is written once
    (the output starts uninitialised), also with more threads than rows or cores."""
    torch.manual_seed(n)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(n, 64, dtype=torch.bfloat16) * 0.05
    want = F.linear(x.float(), w.float())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in matmul_kinds(kernels):
            for rows in (1, 3):
                got = kernels._module.linear_bf16(x[:rows], w, *kind).float()
                torch.testing.assert_close(got, want[:rows], rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    finally:
        torch.set_num_threads(before)


def test_linear_kernel_reads_strided_rows(kernels):
    """Rows sliced out of a wider tensor (a view, not contiguous) give the same result as a copy."""
    wide = torch.randn(4, 256, dtype=torch.bfloat16)
    x = wide[:, :128]
    w = torch.randn(32, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, w), kernels.linear(x.contiguous(), w))


def test_linear_leading_dims_and_fallbacks(kernels):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    assert kernels.linear(x, w).shape == (2, 3, 16)
    many = torch.randn(300, 64, dtype=torch.bfloat16)  # a prefill chunk: a GEMM
    want = F.linear(many.float(), w.float())
    torch.testing.assert_close(kernels.linear(many, w).float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    fp32 = torch.randn(1, 64)
    torch.testing.assert_close(kernels.linear(fp32, w.float()), F.linear(fp32, w.float()))
    odd_k = torch.randn(2, 40, dtype=torch.bfloat16)  # K not a multiple of 16: torch's path
    w_odd = torch.randn(8, 40, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(odd_k, w_odd), F.linear(odd_k, w_odd))


def test_every_matmul_plan_agrees(kernels):
    """Whichever split the load-time timing picks, results match an fp32 matmul."""
    x, w = torch.randn(100, 64, dtype=torch.bfloat16), torch.randn(24, 64, dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float())
    planned = kernels.plan
    try:
        for max_rows in KERNEL_ROWS_CHOICES:
            for large in (F.linear, linear_via_fp32):
                kernels.plan = KernelPlan(max_rows, large, planned.prefill_attention_dtypes)
                for rows in (1, max_rows, max_rows + 1, 100):
                    got = kernels.linear(x[:rows], w).float()
                    torch.testing.assert_close(got, want[:rows], rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    finally:
        kernels.plan = planned


def test_prefill_attention_follows_the_plan(kernels):
    """Where the plan leaves a dtype's prefill attention to SDPA, the kernel declines it (the model then
    gathers K/V and calls SDPA); where the plan takes it, the kernel runs it."""
    q, k_pool = torch.randn(4, 2, 64, dtype=torch.bfloat16), torch.randn(8, 1, 64, dtype=torch.bfloat16)
    planned = kernels.plan
    try:
        for dtypes in (frozenset(), frozenset({torch.bfloat16})):
            kernels.plan = KernelPlan(planned.max_kernel_rows, planned.large_matmul, dtypes)
            assert kernels.supports_prefill_attention(q, k_pool) == (torch.bfloat16 in dtypes)
    finally:
        kernels.plan = planned


def test_bf16_pairs_where_the_cpu_has_them(kernels):
    flags = open("/proc/cpuinfo").read().split()
    assert kernels.bf16_dot_products == ("avx512_bf16" in flags)
    pool, q = torch.randn(8, 1, 32), torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="bf16 dot products need bf16 inputs"):
        kernels._module.paged_prefill_attention(q, pool, pool, torch.tensor([[0]]), 8, torch.tensor([0, 2]),
                                                torch.tensor([2]), 1.0, True, False, torch.empty_like(q))  # fp32 inputs
    if not kernels.bf16_dot_products:  # asked for anyway: refused, not an illegal instruction
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            x, w = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(3, 16, dtype=torch.bfloat16)
            kernels._module.linear_bf16(x, w, True, False)
        bf16_pool = torch.ones(8, 1, 32, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            q = torch.ones(1, 2, 32, dtype=torch.bfloat16)
            kernels._module.paged_decode_attention(q, bf16_pool, bf16_pool, torch.tensor([[0]]), 8, torch.tensor([4]),
                                                   1.0, True, False, 3, torch.empty_like(q))
    if kernels.amx_tiles:
        assert "amx_bf16" in flags and "amx_tile" in flags
    else:  # asked for anyway: refused, not an illegal instruction
        with pytest.raises(RuntimeError, match="no AMX tiles"):
            x, w = torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(32, 32, dtype=torch.bfloat16)
            kernels._module.linear_bf16(x, w, True, True)
        with pytest.raises(RuntimeError, match="a CPU that grants the tiles"):
            bf16_pool = torch.ones(8, 1, 64, dtype=torch.bfloat16)
            q = torch.ones(2, 2, 64, dtype=torch.bfloat16)
            kernels._module.paged_prefill_attention(q, bf16_pool, bf16_pool, torch.tensor([[0]]), 8,
                                                    torch.tensor([0, 2]), torch.tensor([2]), 1.0,
                                                    kernels.bf16_dot_products, True, torch.empty_like(q))


def test_rms_norm_matches_transformers_rounding(kernels):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 1024, dtype=torch.bfloat16) * 3
    weight = (torch.rand(1024) + 0.5).to(torch.bfloat16)
    want = weight * rms_normalize(x, 1e-6)
    got = kernels.rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # fp32 sums in another order may land a value on the other side of a bf16 rounding boundary
    differing = (got != want).float().mean()
    assert differing < 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 2, 32), (2, 1, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_qk_norm_rope_matches_torch_ops(kernels, heads, kv_heads, head_dim, strided):
    torch.manual_seed(head_dim)
    tokens = 7
    # strided: the q/k heads of a fused q/k/v projection's output, as the model passes them (read in place)
    fused = torch.randn(tokens, heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16)
    qk = fused[:, : heads + kv_heads] if strided else fused[:, : heads + kv_heads].contiguous()
    q_weight = (torch.rand(head_dim) + 0.5).to(torch.bfloat16)
    k_weight = (torch.rand(head_dim) + 0.5).to(torch.bfloat16)
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2)[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)[:, None, :]
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(torch.bfloat16)[:, None, :]
    weight = torch.cat((q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)))
    want = apply_rotary(rms_normalize(qk, 1e-6) * weight, cos, signed_sin)
    got = kernels.qk_norm_rope(qk, q_weight, k_weight, heads, 1e-6, cos, signed_sin)
    assert got.dtype == torch.bfloat16 and got.shape == qk.shape
    assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(1, 2 * 3072), (7, 2 * 96), (2, 3, 2 * 16)])
def test_silu_mul_matches_transformers_rounding(kernels, shape):
    torch.manual_seed(shape[0])
    gate_up = (torch.randn(shape) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up  # transformers' SwiGLU in bf16: each op rounds
    assert kernels.supports_silu_mul(gate_up)
    got = kernels.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # another exp may land a value on the other side of a bf16 rounding boundary, rarely
    assert (got != want).float().mean() < 2e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
