"""The compiled CPU kernels against torch (skipped where the CPU cannot run them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_has_avx512_bf16, load_cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "the CPU supports AVX512-BF16 but the kernels did not build"
    return loaded


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(64, 7), (1024, 4096), (96, 130)])
def test_gemv_matches_torch_linear(kernels, rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    got = kernels.linear(x, w)
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 accumulation then one bf16 rounding: within 1% of the magnitude
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_linear_leading_dims_and_fallback(kernels):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    assert kernels.linear(x, w).shape == (2, 3, 16)
    many = torch.randn(20, 64, dtype=torch.bfloat16)  # beyond the kernel's rows: torch's path
    torch.testing.assert_close(kernels.linear(many, w), F.linear(many, w))
    fp32 = torch.randn(1, 64)
    torch.testing.assert_close(kernels.linear(fp32, w.float()), F.linear(fp32, w.float()))


def reference_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale):
    outs = []
    for b in range(q.shape[0]):
        keys = k_pool[slots[b, : ctx_lens[b]]].float().transpose(0, 1)  # (KV, C, D)
        values = v_pool[slots[b, : ctx_lens[b]]].float().transpose(0, 1)
        out = F.scaled_dot_product_attention(q[b].float()[:, None], keys, values, scale=scale, enable_gqa=True)
        outs.append(out[:, 0])
    return torch.stack(outs)  # (B, H, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (16, 8, 128), (4, 4, 16)])
def test_paged_decode_attention_matches_sdpa(kernels, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads + head_dim)
    num_slots, batch = 200, 3
    k_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    ctx_lens = torch.tensor([1, 57, 120])
    slots = torch.stack([torch.randperm(num_slots)[:120] for _ in range(batch)])  # scattered pages
    scale = head_dim**-0.5
    got = kernels.decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale)
    want = reference_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
