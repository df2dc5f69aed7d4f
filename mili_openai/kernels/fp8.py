"""fp8 e4m3 weights as the kernels take them, the torch reference of each matmul over them, and which matmul a
call takes.

Layout (`Fp8Weights`): `weight` float8_e4m3fn (N, K); `scales` float32 (ceil(N / rows), ceil(K / columns)), one
per (rows, columns) `block` of the weight, multiplied in: weight[n, k] = e4m3 * scales[n // rows, k // columns].
`--quantization fp8` stores one scale per output row (block (1, K), scales (N, 1)); fine-grained FP8
checkpoints (Qwen3-*-FP8, DeepSeek-style `weight_scale_inv`) store 128x128 blocks.

Two matmuls, as vLLM and SGLang run fp8 weights:
- weight-only: x in its own dtype times the weights dequantized in registers, float32 sums. It reads the
  weights' bytes once and nothing else, so it is the decode path (few rows of x, bound by reading weights),
  and the only one for block scales and for float32 activations. Its reference is the matmul on the
  dequantized weights, the weights transformers is given in tests.
- W8A8: x quantized to e4m3 per token (a scale per row, max|x| / 448), one torch._scaled_mm on fp8 tensor
  cores (Hopper and later), for many rows of bf16/fp16 x (prefill), where the matmul is bound by arithmetic.
  Its reference is `w8a8_reference`: the same quantization, emulated in float32.
`uses_weight_only` is the switch, by the number of rows: a CUDA graph's decode batch always takes one path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8_MIN_SCALE = 1e-12  # a row of zeros still divides by something
# Up to this many rows of x (a decode batch), the weight-only matmul: reading the weights bounds both
# paths there, and it launches one kernel where W8A8 launches two (quantize x, then the matmul). Past it the
# bf16 tensor-core work of the weight-only kernel outgrows reading the weights on Hopper (about 150 rows of
# x per weight byte), where fp8 tensor cores do twice the work per cycle.
WEIGHT_ONLY_MAX_ROWS = 128
W8A8_DTYPES = (torch.bfloat16, torch.float16)  # _scaled_mm writes bf16/fp16; float32 x stays weight-only


class Fp8Weights(NamedTuple):
    """One projection's fp8 weight in the layout above."""

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    scales: torch.Tensor  # (ceil(N / rows), ceil(K / columns)) float32
    block: tuple[int, int]  # (rows, columns) of the weight per scale

    @property
    def per_row(self) -> bool:
        """One scale per output row (dynamic `--quantization fp8`): what _scaled_mm's row-wise scales take."""
        return self.block[0] == 1 and self.scales.shape[1] == 1


def per_row_weights(weight: torch.Tensor, scales: torch.Tensor) -> Fp8Weights:
    """e4m3 (N, K) with a scale per row (N,) -> the layout above."""
    return Fp8Weights(weight, scales.reshape(-1, 1), (1, weight.shape[1]))


def dequantize_fp8(weights: Fp8Weights) -> torch.Tensor:
    """The float32 (N, K) the e4m3 weight and its scales stand for."""
    rows, columns = weights.weight.shape
    block_rows, block_columns = weights.block
    scales = weights.scales.repeat_interleave(block_rows, dim=0)[:rows]
    scales = scales.repeat_interleave(block_columns, dim=1)[:, :columns]
    return weights.weight.float() * scales


def uses_weight_only(rows: int, dtype: torch.dtype, weights: Fp8Weights) -> bool:
    """Whether a matmul of `rows` rows of x in `dtype` runs weight-only (else W8A8 through _scaled_mm)."""
    return rows <= WEIGHT_ONLY_MAX_ROWS or dtype not in W8A8_DTYPES or not weights.per_row


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: x (M, K) -> (e4m3 (M, K), float32 scales (M, 1))."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=FP8_MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def weight_only_reference(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    """x (..., K) @ dequantized.T, in float32, rounded once to x's dtype."""
    return F.linear(x.float(), dequantize_fp8(weights)).to(x.dtype)


def w8a8_reference(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    """x quantized per row to e4m3 times the e4m3 weights, both scales applied in float32 (row-wise weight
    scales only): what _scaled_mm computes, summed in another order."""
    flat = x.reshape(-1, x.shape[-1])
    q, x_scale = quantize_rows_fp8(flat)
    out = F.linear(q.float() * x_scale, dequantize_fp8(weights))
    return out.to(x.dtype).view(*x.shape[:-1], weights.weight.shape[0])


def scaled_mm(q: torch.Tensor, x_scale: torch.Tensor, weights: Fp8Weights, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 x (M, K) with its row scales (M, 1) times the row-scaled e4m3 weights on fp8 tensor cores -> (M, N)
    in `dtype` (written in bf16: torch's row-wise kernel writes no other)."""
    out = torch._scaled_mm(q, weights.weight.t(), scale_a=x_scale, scale_b=weights.scales.view(1, -1),
                           out_dtype=torch.bfloat16)
    return out.to(dtype)


def torch_fp8_linear(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    """The matmul without Triton: on CUDA, W8A8 through _scaled_mm where `uses_weight_only` says so, else the
    dequantized weight (the whole of it, at every call); elsewhere the float32 references."""
    flat = x.reshape(-1, x.shape[-1])
    weight_only = uses_weight_only(flat.shape[0], x.dtype, weights)
    if not x.is_cuda:
        return weight_only_reference(x, weights) if weight_only else w8a8_reference(x, weights)
    if weight_only:
        return F.linear(x, dequantize_fp8(weights).to(x.dtype))
    out = scaled_mm(*quantize_rows_fp8(flat), weights, x.dtype)
    return out.view(*x.shape[:-1], weights.weight.shape[0])
