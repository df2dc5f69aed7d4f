"""fp8 e4m3 weights on CUDA in Triton (the layout and the two matmuls of kernels/fp8.py).

- `_fp8_weight_only_matmul`: each program owns a (BLOCK_M, BLOCK_N) tile of y and walks K, loading its e4m3
  weight rows and converting them in registers to x's dtype (exact: every e4m3 value is a bf16 and a
  float16), one tl.dot in float32 per K tile. Scales multiply the float32 sums: a weight row's one scale at
  the end, a 128x128 block's after each K tile (BLOCK_K divides the block, so a tile has one scale per
  column). One launch per projection, nothing quantized on the activations' side.
- `_quantize_rows_fp8`: the W8A8 path's activation quantization in one launch: a program per row of x
  takes max|x| over the row, its scale, and writes the row's e4m3 bytes (the scale and the rounding of
  `quantize_rows_fp8`, with the same float32 arithmetic); torch._scaled_mm then runs the matmul.

`triton_fp8_linear` is None where Triton cannot be imported. Tests run both kernels under Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors. It loads every finite e4m3 value exactly, but its float32 ->
e4m3 conversion mis-rounds where the mantissa carries, so the quantization rounds in integer ops (the same
code on the GPU); the dot runs in float32 there on the same values (its bf16 tl.dot is not the GPU's).
"""

from __future__ import annotations

import torch

from mili_openai.kernels.fp8 import (
    FP8_MAX,
    FP8_MIN_SCALE,
    WEIGHT_ONLY_MAX_ROWS,
    Fp8Weights,
    scaled_mm,
    torch_fp8_linear,
    uses_weight_only,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: callers keep the torch paths
    triton = None

DOT_SIDES = (256, 128, 64, 32, 16)  # K tiles, widest first
MIN_DOT = 16  # tl.dot's smallest tile side
NARROW_WEIGHT_ROWS = 2048  # up to this many output rows, decode takes 16-row column tiles
QUANTIZE_BLOCK = 1024  # values of a row of x a program takes at once
PIPELINE_STAGES = 3


if triton is not None:

    # M, the step's row count, varies from step to step: one compiled variant for every value
    @triton.jit(do_not_specialize=["M"])
    def _fp8_weight_only_matmul(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, scale_columns, block_rows, block_columns,
                                ONE_K_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of x
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) weight rows
        row_ok, col_ok = rows < M, cols < N
        scale_row = s_ptr + (cols // block_rows) * scale_columns  # (BN,) each weight row's first scale
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # (BK,)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:  # float32 activations, or the interpreter: exact products of the same values
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if ONE_K_SCALE:
                acc += part
            else:
                scale = tl.load(scale_row + k0 // block_columns, mask=col_ok, other=0.0)  # (BN,)
                acc += part * scale[None, :]
        if ONE_K_SCALE:
            acc = acc * tl.load(scale_row, mask=col_ok, other=0.0)[None, :]
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _e4m3_bits(v):
        """float32 within +-448 -> its e4m3fn byte, rounded to nearest, ties to even (torch's conversion), in
        integer ops: the interpreter's own float8 conversion mis-rounds where the mantissa carries."""
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        magnitude = bits & 0x7FFFFFFF
        # normal (>= 2^-6): rebias the exponent (127 -> 7), keep 3 of 23 mantissa bits, a carry moves the exponent
        rebiased = magnitude - (120 << 23)
        normal = (rebiased + 0x7FFFF + ((rebiased >> 20) & 1)) >> 20
        # subnormal (< 2^-6): steps of 2^-9, rounded by float32 addition (2^23 leaves no fraction bits)
        steps = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
        code = tl.where(magnitude < (121 << 23), steps, normal)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _quantize_rows_fp8(x_ptr, q_ptr, s_ptr, K, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = row.to(tl.int64) * K
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + base + ks, mask=ks < K, other=0.0).to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_SCALE), FP8_MAX)  # IEEE division, as torch's
        for k0 in range(0, K, BLOCK):  # the row again, from cache
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + ks, mask=ks < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + base + ks, _e4m3_bits(q), mask=ks < K)
        tl.store(s_ptr + row, scale)


def _k_tile(weights: Fp8Weights, widest: int) -> int | None:
    """The K tile: `widest`, or the widest that lies inside one block of scales (None: no tile does)."""
    if weights.scales.shape[1] == 1:
        return widest
    return next((side for side in DOT_SIDES if side <= widest and weights.block[1] % side == 0), None)


def _tiles(rows: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, widest BLOCK_K, num_warps). A decode batch is bound by reading the weight: narrow
    tiles make more programs over a small weight (those sharing a weight tile run side by side and read it
    from L2), and one row tile of x, with K tiles of 256, keeps more of the weight's bytes in flight per
    program. Prefill-sized batches take larger tiles, which read the weight fewer times."""
    if rows > WEIGHT_ONLY_MAX_ROWS:
        return 64, 128, DOT_SIDES[1], 8
    block_n = MIN_DOT if n <= NARROW_WEIGHT_ROWS else 2 * MIN_DOT
    if rows <= MIN_DOT:
        return MIN_DOT, block_n, DOT_SIDES[0], 4
    return 2 * MIN_DOT, block_n, DOT_SIDES[1], 4


def fp8_weight_only_linear(flat: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    """x (M, K) contiguous @ dequantized.T -> (M, N) in x's dtype, float32 sums."""
    rows, k = flat.shape
    n = weights.weight.shape[0]
    y = torch.empty(rows, n, dtype=flat.dtype, device=flat.device)
    if rows == 0:
        return y
    block_m, block_n, widest_k, warps = _tiles(rows, n)
    block_k = _k_tile(weights, widest_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _fp8_weight_only_matmul[grid](flat, weights.weight, weights.scales, y, rows, n, k, weights.scales.shape[1],
                                  weights.block[0], weights.block[1], ONE_K_SCALE=weights.scales.shape[1] == 1,
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                  DOT_FP32=flat.dtype == torch.float32 or flat.device.type == "cpu",
                                  num_warps=warps, num_stages=PIPELINE_STAGES)
    return y


def quantize_rows(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) contiguous -> (e4m3 (M, K), float32 scales (M, 1)), as `quantize_rows_fp8`, in one launch."""
    rows, k = flat.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=flat.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=flat.device)
    if rows:  # the kernel writes each value's byte
        _quantize_rows_fp8[(rows,)](flat, q.view(torch.uint8), scales, k, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                                    BLOCK=min(QUANTIZE_BLOCK, triton.next_power_of_2(k)))
    return q, scales


def _triton_fp8_linear(x: torch.Tensor, weights: Fp8Weights) -> torch.Tensor:
    """x (..., K) @ the fp8 weights -> (..., N) in x's dtype: weight-only or W8A8 as `uses_weight_only` says."""
    if _k_tile(weights, DOT_SIDES[0]) is None:  # blocks narrower than a dot tile: the dequantized weight
        return torch_fp8_linear(x, weights)
    k, n = x.shape[-1], weights.weight.shape[0]
    flat = x.reshape(-1, k).contiguous()
    if uses_weight_only(flat.shape[0], x.dtype, weights):
        out = fp8_weight_only_linear(flat, weights)
    else:
        out = scaled_mm(*quantize_rows(flat), weights, x.dtype)
    return out.view(*x.shape[:-1], n)


triton_fp8_linear = _triton_fp8_linear if triton is not None else None
