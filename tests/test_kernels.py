"""The compiled CPU kernels against torch (skipped where the CPU cannot run them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.planning import DECODE_PREFETCH_CHOICES, KERNEL_ROWS_CHOICES, KernelPlan, linear_via_fp32
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


def reference_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale):
    outs = []
    for b in range(q.shape[0]):
        keys = k_pool[slots[b, : ctx_lens[b]]].float().transpose(0, 1)  # (KV, C, D)
        values = v_pool[slots[b, : ctx_lens[b]]].float().transpose(0, 1)
        out = F.scaled_dot_product_attention(q[b].float()[:, None], keys, values, scale=scale, enable_gqa=True)
        outs.append(out[:, 0])
    return torch.stack(outs)  # (B, H, D)


# context lengths: partial blocks of 16 slots; one long context the kernel splits into several spans
# (merged afterwards) beside short ones that fit one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (16, 8, 128), (4, 4, 16), (6, 2, 64)])
@pytest.mark.parametrize("lengths", [(1, 57, 120), (1000, 3)])
def test_paged_decode_attention_matches_sdpa(kernels, dtype, heads, kv_heads, head_dim, lengths):
    torch.manual_seed(heads + head_dim)
    num_slots, batch, width = 1200, len(lengths), max(lengths)
    k_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    ctx_lens = torch.tensor(lengths)
    slots = torch.stack([torch.randperm(num_slots)[:width] for _ in range(batch)])  # scattered pages
    scale = head_dim**-0.5
    want = reference_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale)
    # pair products where the CPU has them (bf16 only: fp32 pools ignore the flag), and fp32 products
    for bf16_pairs in product_kinds(kernels):
        for prefetch in DECODE_PREFETCH_CHOICES:
            got = kernels._module.paged_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale, bf16_pairs, False,
                                                         prefetch)
            assert got.dtype == dtype and got.shape == q.shape
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def shared_prefix_slots(num_slots, prefix_len, suffix_lens, pages):
    """Slot rows that begin with the same prefix_len slots (as radix-shared pages do), then each its own.
    pages: the pool's slots in runs of 16 side by side (a page), or scattered one by one."""
    order = torch.randperm(num_slots // 16)[:, None] * 16 + torch.arange(16) if pages else torch.randperm(num_slots)
    order = order.flatten()
    prefix, taken = order[:prefix_len], prefix_len
    rows = []
    for length in suffix_lens:
        rows.append(torch.cat([prefix, order[taken:taken + length]]))
        taken += length
    width = max(len(row) for row in rows)
    return torch.stack([F.pad(row, (0, width - len(row))) for row in rows]), torch.tensor([len(r) for r in rows])


# groups of sequences that share a prefix (cascade attention on AMX tiles): prefixes that are and are not
# whole 32-slot steps, members that share too little to join, more members than a score tile holds
# (16 query heads), and head shapes: Qwen3-0.6B's, a group of 4, MHA at head_dim 64
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (8, 2, 64), (4, 4, 64)])
@pytest.mark.parametrize("prefix_len,suffix_lens", [(960, [64] * 8), (203, [1, 70, 5, 300]),
                                                    (100, [3] * 20), (64, [1, 1])])
@pytest.mark.parametrize("pages", [True, False])
def test_paged_decode_attention_attends_shared_prefixes_once(kernels, heads, kv_heads, head_dim, prefix_len,
                                                             suffix_lens, pages):
    if not kernels.amx_tiles:
        pytest.skip("this CPU has no AMX tiles")
    torch.manual_seed(prefix_len + heads)
    num_slots = 4096
    k_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=torch.bfloat16)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=torch.bfloat16)
    slots, ctx_lens = shared_prefix_slots(num_slots, prefix_len, suffix_lens, pages)
    stranger, stranger_len = shared_prefix_slots(num_slots, 40, [30], pages)  # shares 40 slots: too few
    width = max(slots.shape[1], stranger.shape[1])
    slots = torch.cat([F.pad(slots, (0, width - slots.shape[1])), F.pad(stranger, (0, width - stranger.shape[1]))])
    slots[-1, :40] = slots[0, :40]
    ctx_lens = torch.cat([ctx_lens, stranger_len])
    q = torch.randn(len(ctx_lens), heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    want = reference_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale)
    got = kernels._module.paged_decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale, True, True, 1).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # outputs average many V rows, so they are small: also hold the error to 1% of their overall size
    for row_got, row_want in zip(got, want):
        assert float((row_got - row_want).norm() / row_want.norm()) < 1e-2


def test_paged_decode_attention_refuses_empty_or_overlong_contexts(kernels):
    pool = torch.randn(10, 2, 32, dtype=torch.bfloat16)
    q, slots = torch.randn(1, 4, 32, dtype=torch.bfloat16), torch.arange(4)[None]
    for length in (0, 5):
        with pytest.raises(RuntimeError, match="each context holds"):
            kernels.decode_attention(q, pool, pool, slots, torch.tensor([length]), 1.0)


def reference_prefill_attention(q, k_pool, v_pool, context_slots, scale):
    length, ctx = q.shape[0], context_slots.shape[0]
    keys = k_pool[context_slots].float().transpose(0, 1)  # (KV, C, D)
    values = v_pool[context_slots].float().transpose(0, 1)
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - length, ctx)[:, None]  # bottom-right causal
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=visible, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)  # (L, H, D)


def prefill_products(kernels):
    """(dtype, multiply bf16 pairs, AMX tiles) that this CPU can run: fp32; bf16 widened; bf16 pairs where it
    has them; bf16 on AMX tiles (head_dim 64 and 128; other heads fall back to pairs) where it has those."""
    combos = [(torch.float32, False, False), (torch.bfloat16, False, False)]
    if kernels.bf16_dot_products:
        combos.append((torch.bfloat16, True, False))
    if kernels.amx_tiles:
        combos.append((torch.bfloat16, True, True))
    return combos


# (chunk length, context length): a whole prompt, a chunk after a cached prefix, one token, lengths that
# leave partial query and key blocks (and an odd last block, which bf16 pairs pad); head shapes:
# Qwen3-0.6B's, MHA, and groups that do not divide 64
@pytest.mark.parametrize("length,ctx", [(130, 130), (64, 1000), (1, 7), (37, 100)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 4, 16), (40, 8, 32), (8, 1, 64)])
def test_paged_prefill_attention_matches_sdpa(kernels, length, ctx, heads, kv_heads, head_dim):
    for dtype, bf16_pairs, amx_tiles in prefill_products(kernels):
        torch.manual_seed(length + heads)
        num_slots = ctx + 40
        k_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
        v_pool = torch.randn(num_slots, kv_heads, head_dim, dtype=dtype)
        context_slots = torch.randperm(num_slots)[:ctx]  # scattered pages
        qk = torch.randn(length, heads + kv_heads, head_dim, dtype=dtype)
        q = qk[:, :heads]  # as the model passes it: rows strided, each row's heads contiguous
        assert kernels.prefill_attention_fits(q, k_pool)
        scale = head_dim**-0.5
        got = kernels._module.paged_prefill_attention(q, k_pool, v_pool, context_slots, scale, bf16_pairs,
                                                      amx_tiles)
        want = reference_prefill_attention(q, k_pool, v_pool, context_slots, scale)
        assert got.dtype == dtype and got.shape == q.shape
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def test_bf16_pairs_where_the_cpu_has_them(kernels):
    flags = open("/proc/cpuinfo").read().split()
    assert kernels.bf16_dot_products == ("avx512_bf16" in flags)
    pool, q = torch.randn(8, 1, 32), torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="bf16 dot products need bf16 inputs"):
        kernels._module.paged_prefill_attention(q, pool, pool, torch.arange(2), 1.0, True, False)  # fp32 inputs
    if not kernels.bf16_dot_products:  # asked for anyway: refused, not an illegal instruction
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            x, w = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(3, 16, dtype=torch.bfloat16)
            kernels._module.linear_bf16(x, w, True, False)
        bf16_pool = torch.ones(8, 1, 32, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            kernels._module.paged_decode_attention(torch.ones(1, 2, 32, dtype=torch.bfloat16), bf16_pool, bf16_pool,
                                                   torch.arange(4)[None], torch.tensor([4]), 1.0, True, False, 3)
    if kernels.amx_tiles:
        assert "amx_bf16" in flags and "amx_tile" in flags
    else:  # asked for anyway: refused, not an illegal instruction
        with pytest.raises(RuntimeError, match="no AMX tiles"):
            x, w = torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(32, 32, dtype=torch.bfloat16)
            kernels._module.linear_bf16(x, w, True, True)
        with pytest.raises(RuntimeError, match="a CPU that grants the tiles"):
            bf16_pool = torch.ones(8, 1, 64, dtype=torch.bfloat16)
            kernels._module.paged_prefill_attention(torch.ones(2, 2, 64, dtype=torch.bfloat16), bf16_pool,
                                                    bf16_pool, torch.arange(2), 1.0, kernels.bf16_dot_products, True)


def test_paged_prefill_attention_refuses_slots_outside_the_pool(kernels):
    k_pool = torch.randn(10, 2, 32, dtype=torch.bfloat16)
    q = torch.randn(3, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.prefill_attention(q, k_pool, k_pool, torch.tensor([0, 1, 10]), 1.0)


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
