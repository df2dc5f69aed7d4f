"""The compiled CPU attention kernels through page tables, against the float64 torch references the Triton
kernels are held to (kernels/attention_reference.py): pages scattered and out of order, odd context
lengths, page sizes 1 and 16, int64 and int32 tables, grouped-query heads. Skipped where the CPU cannot run
the kernels."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.attention_reference import paged_decode_reference, paged_prefill_reference
from mili_openai.kernels.planning import DECODE_PREFETCH_CHOICES

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")

FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 2e-2


def product_kinds(kernels) -> list[bool]:
    """Whether to multiply bf16 pairs: never (widened fp32), and also where the CPU has them (AVX512-BF16)."""
    return [False, True] if kernels.bf16_dot_products else [False]


def scattered_tables(lengths: list[int], page_size: int, num_pages: int, seed: int,
                     shared_pages: int = 0) -> torch.Tensor:
    """(rows, W) int64 page tables over shuffled pages (no row's pages in order), the first `shared_pages`
    of every row the same ones (as radix-shared pages are); padding past a row's pages is page 0."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    shared, taken = order[:shared_pages], shared_pages
    rows = []
    for length in lengths:
        own = -(-length // page_size) - shared_pages
        rows.append(shared + order[taken : taken + own])
        taken += own
    assert taken <= num_pages
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)


def pools(num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2)]


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


# contexts: partial pages and blocks; one long context the kernel splits into spans (merged after) beside
# short ones; heads: Qwen3-0.6B's, MHA at head_dim 16, groups of 3, Qwen3.5's attention (head_dim 256)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 4, 16), (6, 2, 64), (8, 2, 256)])
@pytest.mark.parametrize("lengths", [(1, 57, 120), (1000, 3, 17)])
@pytest.mark.parametrize("page_size,index_dtype", [(16, torch.int64), (1, torch.int32), (16, torch.int32)])
def test_decode_attention_through_page_tables(kernels, dtype, heads, kv_heads, head_dim, lengths, page_size,
                                              index_dtype):
    num_pages = 1200 // page_size * 2
    k_pool, v_pool = pools(num_pages * page_size, kv_heads, head_dim, dtype, seed=heads + head_dim)
    table = scattered_tables(list(lengths), page_size, num_pages, seed=page_size).to(index_dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    ctx_lens, scale = torch.tensor(lengths), head_dim**-0.5
    want = paged_decode_reference(q, k_pool, v_pool, table, page_size, ctx_lens, scale)
    # pair products where the CPU has them (bf16 only: fp32 pools ignore the flag), and fp32 products
    for bf16_pairs in product_kinds(kernels):
        for prefetch in DECODE_PREFETCH_CHOICES:
            got = torch.empty_like(q)
            kernels._module.paged_decode_attention(q, k_pool, v_pool, table, page_size, ctx_lens, scale, bf16_pairs,
                                                   False, prefetch, got)
            assert_matches(got, want, dtype)
    out = torch.zeros(len(lengths) + 2, heads, head_dim, dtype=dtype)  # into rows of a larger output, as mixed
    kernels.paged_decode_attention(q, k_pool, v_pool, table, page_size, ctx_lens, scale, out=out[1:-1])  # steps do
    assert_matches(out[1:-1], want, dtype)
    assert not out[0].any() and not out[-1].any()


# groups of sequences that share a prefix of pages (cascade attention on AMX tiles): prefixes that are and
# are not whole 32-slot steps, members that share too little to join, more members than a score tile
# holds (16 query heads), and head shapes: Qwen3-0.6B's, a group of 4, MHA at head_dim 64
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (8, 2, 64), (4, 4, 64)])
@pytest.mark.parametrize("prefix_len,suffix_lens", [(960, [64] * 8), (203, [1, 70, 5, 300]),
                                                    (100, [3] * 20), (64, [1, 1])])
@pytest.mark.parametrize("page_size", [16, 1])
def test_decode_attention_attends_shared_pages_once(kernels, heads, kv_heads, head_dim, prefix_len, suffix_lens,
                                                    page_size):
    if not kernels.amx_tiles:
        pytest.skip("this CPU has no AMX tiles")
    num_pages = 4096 // page_size
    k_pool, v_pool = pools(num_pages * page_size, kv_heads, head_dim, torch.bfloat16, seed=prefix_len + heads)
    shared = -(-prefix_len // page_size)
    lengths = [shared * page_size + suffix for suffix in suffix_lens]
    table = scattered_tables(lengths, page_size, num_pages, seed=prefix_len, shared_pages=shared)
    # a stranger that shares only 40 slots' pages with the first row: too few to join it
    stranger_pages = -(-40 // page_size)
    used = set(table.flatten().tolist())
    fresh = [page for page in range(num_pages) if page not in used][: -(-30 // page_size)]
    stranger = torch.tensor(table[0, :stranger_pages].tolist() + fresh)
    width = max(table.shape[1], len(stranger))
    table = torch.cat([torch.nn.functional.pad(table, (0, width - table.shape[1])),
                       torch.nn.functional.pad(stranger, (0, width - len(stranger)))[None]])
    ctx_lens = torch.tensor([*lengths, stranger_pages * page_size + 30])
    q = torch.randn(len(ctx_lens), heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    want = paged_decode_reference(q, k_pool, v_pool, table, page_size, ctx_lens, scale).float()
    got = torch.empty_like(q)
    kernels._module.paged_decode_attention(q, k_pool, v_pool, table, page_size, ctx_lens, scale, True, True, 1, got)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # outputs average many V rows, so they are small: also hold the error to 1% of their overall size
    for row_got, row_want in zip(got.float(), want):
        assert float((row_got - row_want).norm() / row_want.norm()) < 1e-2


def test_decode_attention_refuses_bad_contexts_and_pages(kernels):
    pool = torch.randn(32, 2, 32, dtype=torch.bfloat16)  # 2 pages of 16
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    table = torch.tensor([[1]])
    for length in (0, 17):  # empty, or past the row's pages
        with pytest.raises(RuntimeError, match="page table row holds"):
            kernels.paged_decode_attention(q, pool, pool, table, 16, torch.tensor([length]), 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_decode_attention(q, pool, pool, torch.tensor([[2]]), 16, torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="int64 or int32"):
        kernels.paged_decode_attention(q, pool, pool, table.float(), 16, torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="page_size divides"):
        kernels.paged_decode_attention(q, pool, pool, table, 5, torch.tensor([3]), 1.0)


def prefill_products(kernels):
    """(dtype, multiply bf16 pairs, AMX tiles) that this CPU can run: fp32; bf16 widened; bf16 pairs where it
    has them; bf16 on AMX tiles (head_dim 64 and 128; other heads fall back to pairs) where it has those."""
    combos = [(torch.float32, False, False), (torch.bfloat16, False, False)]
    if kernels.bf16_dot_products:
        combos.append((torch.bfloat16, True, False))
    if kernels.amx_tiles:
        combos.append((torch.bfloat16, True, True))
    return combos


# one call, every chunk: a whole prompt, a chunk after a cached prefix, one token, lengths that leave partial
# query and key blocks (and an odd last block, which bf16 pairs pad); head shapes: Qwen3-0.6B's, MHA, and
# groups that do not divide 64, and Qwen3.5's head_dim 256
CHUNKS = [(130, 130), (64, 1000), (1, 7), (37, 100)]  # (new tokens, context after them)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 4, 16), (40, 8, 32), (8, 1, 64), (8, 2, 256)])
@pytest.mark.parametrize("page_size,index_dtype", [(16, torch.int64), (1, torch.int32)])
def test_prefill_attention_through_page_tables(kernels, heads, kv_heads, head_dim, page_size, index_dtype):
    lengths = [length for length, _ in CHUNKS]
    ctx_lens = torch.tensor([ctx for _, ctx in CHUNKS])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    num_pages = 1400 // page_size
    table = scattered_tables(ctx_lens.tolist(), page_size, num_pages, seed=heads).to(index_dtype)
    scale = head_dim**-0.5
    for dtype, bf16_pairs, amx_tiles in prefill_products(kernels):
        k_pool, v_pool = pools(num_pages * page_size, kv_heads, head_dim, dtype, seed=heads + head_dim)
        qk = torch.randn(sum(lengths), heads + kv_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
        q = qk[:, :heads]  # as the model passes it: rows strided, each row's heads contiguous
        assert kernels.prefill_attention_fits(q, k_pool)
        want = paged_prefill_reference(q, k_pool, v_pool, table, page_size, cu_seqlens, ctx_lens, scale)
        got = torch.empty(q.shape, dtype=dtype)
        kernels._module.paged_prefill_attention(q, k_pool, v_pool, table, page_size, cu_seqlens, ctx_lens, scale,
                                                bf16_pairs, amx_tiles, got)
        assert_matches(got, want, dtype)


def test_prefill_attention_refuses_pages_outside_the_pool_and_chunks_past_their_context(kernels):
    k_pool = torch.randn(32, 2, 32, dtype=torch.bfloat16)  # 2 pages of 16
    q = torch.randn(3, 4, 32, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_prefill_attention(q, k_pool, k_pool, torch.tensor([[0, 2]]), 16, cu_seqlens,
                                        torch.tensor([20]), 3, 1.0)
    with pytest.raises(RuntimeError, match="within its context"):
        kernels.paged_prefill_attention(q, k_pool, k_pool, torch.tensor([[0]]), 16, cu_seqlens, torch.tensor([2]),
                                        3, 1.0)
    with pytest.raises(RuntimeError, match="cover q's rows"):
        kernels.paged_prefill_attention(q, k_pool, k_pool, torch.tensor([[0]]), 16, torch.tensor([0, 2]),
                                        torch.tensor([2]), 2, 1.0)
