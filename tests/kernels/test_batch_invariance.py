"""Batch invariance of the compiled CPU kernels a decode step runs: a row's output is the same bits alone as beside
other rows, so a row verifying a draft computes what the plain decode of that token computes and greedy bf16
output does not depend on speculation (docs/speculative.md). The matmul holds it with bf16 pair products
(AVX512-BF16; the widened-fp32 tile sums one row in another order than several) up to the rows it takes
(`max_kernel_rows`, a GEMM beyond); decode attention holds it with either product kind. Skipped where the CPU
cannot run the kernels."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.planning import DECODE_PREFETCH_CHOICES

from test_cpu_attention_kernels import pools, product_kinds, scattered_tables

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")

MAX_CHECKED_ROWS = 17  # two whole chunks of 8 rows and one row beyond


# K: the model's widths and an odd multiple of 16 (the pair products' half-step tail); N: whole tiles of 4 and 3
# weight rows and a remainder
@pytest.mark.parametrize("k,n", [(1024, 203), (48, 37), (3584, 64)])
def test_linear_rows_are_the_same_bits_alone_and_batched(kernels, k, n):
    if not kernels.bf16_dot_products:
        pytest.skip("batch invariance needs the bf16 pair products (AVX512-BF16)")
    generator = torch.Generator().manual_seed(k + n)
    x = torch.randn(MAX_CHECKED_ROWS, k, generator=generator).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    alone = torch.cat([kernels._module.linear_bf16(x[row : row + 1], w, True, False) for row in range(len(x))])
    for rows in range(2, MAX_CHECKED_ROWS + 1):
        assert torch.equal(kernels._module.linear_bf16(x[:rows], w, True, False), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_rows_are_the_same_bits_alone_and_batched(kernels, threads, dtype):
    """A long context (split into spans, merged after) beside a sequence's own verify rows (contexts one apart,
    on the same pages) and other sequences, whose lengths once set the spans of every row."""
    heads, kv_heads, head_dim, page_size = 8, 2, 256, 16  # Qwen3.5's attention
    lengths = [700, 701, 702, 5, 1500, 33]
    num_pages = 200
    k_pool, v_pool = pools(num_pages * page_size, kv_heads, head_dim, dtype, seed=3)
    table = scattered_tables([702, 5, 1500, 33], page_size, num_pages, seed=4)
    table = torch.cat((table[:1], table[:1], table))  # the verify rows repeat their sequence's pages
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    ctx_lens, scale = torch.tensor(lengths), head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pairs in product_kinds(kernels):
            def attend(rows: slice) -> torch.Tensor:
                out = torch.empty_like(q[rows])
                kernels._module.paged_decode_attention(q[rows], k_pool, v_pool, table[rows], page_size,
                                                       ctx_lens[rows], scale, pairs, False,
                                                       DECODE_PREFETCH_CHOICES[0], out)
                return out

            alone = torch.cat([attend(slice(row, row + 1)) for row in range(len(lengths))])
            assert torch.equal(attend(slice(0, len(lengths))), alone)
            assert torch.equal(attend(slice(0, 3)), alone[:3])
    finally:
        torch.set_num_threads(before)
