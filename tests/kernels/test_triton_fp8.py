"""The fp8 Triton kernels (kernels/triton_fp8.py) run by Triton's interpreter on CPU tensors, against their
torch references (kernels/fp8.py). Small shapes: the interpreter runs each program in numpy.

- The weight-only matmul against the matmul on the dequantized weights in float32: the same products (an
  e4m3 value times x, exact in float32), summed in another order, so float32 agrees to rounding and bf16 to
  one output step (the interpreter truncates float32 to bf16 where the GPU rounds).
- The per-token activation quantization bit for bit: the same scales and the same e4m3 bytes, over every
  e4m3 value, the ties between neighbours, subnormals and rows longer than one block; and with
  torch._scaled_mm after it (prefill rows), against the float32 emulation of W8A8.

Triton decides between compiling and interpreting when it is imported, so the kernels run in a process
started with TRITON_INTERPRET=1 (the `interpreter` fixture), and only there."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels.fp8 import (
    WEIGHT_ONLY_MAX_ROWS,
    Fp8Weights,
    per_row_weights,
    quantize_rows_fp8,
    w8a8_reference,
    weight_only_reference,
)
from mili_openai.model.quantization.dynamic import quantize_fp8

pytest.importorskip("triton")

BF16_STEP = 2 ** -7  # one bf16 step, relative to the value (8 significant bits)


def _weight_only(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    from mili_openai.kernels.triton_fp8 import fp8_weight_only_linear

    return fp8_weight_only_linear(x, weights)


def _linear(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    from mili_openai.kernels.triton_fp8 import triton_fp8_linear

    return triton_fp8_linear(x, weights)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from mili_openai.kernels.triton_fp8 import quantize_rows

    return quantize_rows(x)


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 16
    w[1] = 0  # a row of zeros
    w[2] *= 1000  # a far larger row
    return w


def random_blocks(n: int, k: int, block: tuple[int, int], seed: int) -> Fp8Weights:
    """A fine-grained checkpoint's weight: e4m3 values and a scale per block, of differing sizes."""
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=generator) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=generator) / 256 + 1e-4
    return Fp8Weights(q, scales, block)


def assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, weights: Fp8Weights) -> None:
    want = weight_only_reference(x, weights)
    assert got.dtype == x.dtype and got.shape == want.shape
    step = BF16_STEP if x.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=step * float(want.float().abs().max()))


@pytest.mark.parametrize(("rows", "n", "k"), [  # N and K off the tiles
    (1, 72, 320), (5, 2100, 600),  # decode rows: 16- and 32-column tiles, K in tiles of 256
    (17, 72, 320), (40, 72, 320), (130, 72, 320),  # one and two 32-row tiles of x; prefill-sized tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_matmul_with_row_scales(interpreter, rows, n, k, dtype):
    weights = per_row_weights(*quantize_fp8(random_weight(n, k, seed=rows)))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)).to(dtype)
    assert_close_to_reference(interpreter.submit(_weight_only, x, weights).result(), x, weights)


@pytest.mark.parametrize(("rows", "n", "k", "block"), [
    (1, 200, 384, (128, 128)),  # a decode row; N ends inside a block
    (70, 136, 320, (128, 128)),  # a prefill-sized tile; K ends inside a block
    (3, 96, 256, (32, 64)),  # blocks narrower than the tiles: a scale per 64 values of K
])
def test_weight_only_matmul_with_block_scales(interpreter, rows, n, k, block):
    weights = random_blocks(n, k, block, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert_close_to_reference(interpreter.submit(_linear, x, weights).result(), x, weights)


def test_blocks_narrower_than_a_dot_tile_take_the_dequantized_weight(interpreter):
    weights = random_blocks(40, 64, (16, 8), seed=5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    got = interpreter.submit(_linear, x, weights).result()
    torch.testing.assert_close(got, weight_only_reference(x, weights))


def test_quantize_rows_matches_torch_bit_for_bit(interpreter):
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].unique()
    ties = (finite[1:] + finite[:-1]) / 2  # halfway between neighbours: rounded to the even one
    generator = torch.Generator().manual_seed(7)
    spread = torch.randn(1800, generator=generator) * torch.exp2(torch.randint(-12, 8, (1800,), generator=generator))
    row = torch.cat([finite, ties, spread.clamp(-448, 448), torch.tensor([448.0])])  # max 448: scale 1
    x = torch.stack([row, row.flip(0) * 3e-3, torch.zeros_like(row)])  # the zero row keeps a finite scale
    for dtype in (torch.float32, torch.bfloat16):
        q, scales = interpreter.submit(_quantize_rows, x.to(dtype)).result()
        want_q, want_scales = quantize_rows_fp8(x.to(dtype))
        assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
        assert torch.equal(scales, want_scales)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_prefill_rows_quantize_activations_and_run_scaled_mm(interpreter):
    """Past WEIGHT_ONLY_MAX_ROWS rows of bf16 x: the Triton quantization, then torch._scaled_mm (which torch
    also runs on the CPU), against the float32 emulation of the same quantization."""
    weights = per_row_weights(*quantize_fp8(random_weight(48, 256, seed=9)))
    x = torch.randn(WEIGHT_ONLY_MAX_ROWS + 2, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = interpreter.submit(_linear, x, weights).result()
    want = w8a8_reference(x, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=BF16_STEP * float(want.abs().max()))
    assert not torch.equal(want, weight_only_reference(x, weights))  # the activations' quantization shows
