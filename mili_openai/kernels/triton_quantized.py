"""int8/int4 matmuls for CUDA in Triton: y = x @ dequantized(W).T, the weights dequantized tile by tile in
registers (the layouts of kernels/quantized.py, the same bytes the CPU kernels read).

Each program owns a (BLOCK_M, BLOCK_N) tile of y and walks K: it loads its x tile and its weight rows'
packed values, dequantizes them exactly as the torch reference does (float32 product of level and
scale, rounded once to the activations' dtype) and accumulates tl.dot in float32. Decode batches use
the smallest row tile tl.dot takes; weights are read once per row tile.

`triton_quantized_linear` is None where Triton cannot be imported. Tests run it under Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors, where the products run in float32 on the same bf16
values (the interpreter's bf16 tl.dot and its float32 -> bf16 conversion are not the GPU's).
"""

from __future__ import annotations

import torch

from mili_openai.kernels.quantized import (INT4_BLOCK, INT4_LANE, INT4_SYMMETRIC_ZERO, PackedWeights,
                                           int8_input_linear)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: callers keep the torch reference
    triton = None

MIN_DOT = 16  # tl.dot's smallest tile side
BLOCK_N = 64
BLOCK_K = 32  # one int4 nibble lane: 32 values of K from 32 consecutive 16-bit words


if triton is not None:

    # M, the step's row count, varies from step to step: one compiled variant for every value
    @triton.jit(do_not_specialize=["M"])
    def _quantized_matmul(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, groups, group_size,
                          BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT4_BLOCK: tl.constexpr,
                          INT4_LANE: tl.constexpr, SYMMETRIC_ZERO: tl.constexpr, ROUND_BF16: tl.constexpr,
                          DOT_FP32: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of x
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) weight rows
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # (BK,)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = col_ok[:, None] & k_ok[None, :]
            group = ks // group_size
            scale = tl.load(s_ptr + cols[:, None] * groups + group[None, :], mask=wmask, other=0.0).to(tl.float32)
            if BITS == 8:
                q = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=wmask, other=0).to(tl.float32)
                w = q * scale
            else:
                # value k: block k // 128 (64 bytes), little-endian word k % 32, nibble (k % 128) // 32
                word = (ks // INT4_BLOCK) * INT4_BLOCK // 2 + (ks % INT4_LANE) * 2
                base = w_ptr + cols[:, None] * (K // 2) + word[None, :]
                low = tl.load(base, mask=wmask, other=0).to(tl.int32)
                high = tl.load(base + 1, mask=wmask, other=0).to(tl.int32)
                shift = ((ks % INT4_BLOCK) // INT4_LANE) * 4
                level = (((high << 8) | low) >> shift[None, :]) & 0xF
                if HAS_ZEROS:
                    zero = tl.load(z_ptr + cols[:, None] * groups + group[None, :], mask=wmask, other=0).to(tl.float32)
                else:
                    zero = SYMMETRIC_ZERO
                w = (level.to(tl.float32) - zero) * scale
            if ROUND_BF16:  # to the nearest bf16, ties to even, as torch's .to(bfloat16) (kept as float32)
                bits = w.to(tl.uint32, bitcast=True)
                w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            if DOT_FP32:  # float32 activations, or the interpreter (its bf16 tl.dot is wrong): exact products
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # w holds values of x's dtype already: the conversion is exact
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if ROUND_BF16:  # rounded here, in integer ops: the interpreter's own conversion truncates
            bits = acc.to(tl.uint32, bitcast=True)
            acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _row_block(rows: int) -> int:
    """The row tile: decode batches the smallest tl.dot takes, prefill chunks larger."""
    return MIN_DOT if rows <= MIN_DOT else 64


def _triton_quantized_linear(x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
    """x (..., K) @ dequantized(packed).T in x's dtype (W8A8: on x's int8 levels, rows scaled after)."""
    if packed.int8_inputs is not None:
        return int8_input_linear(x, packed, _triton_quantized_linear)
    k, n = packed.in_features, packed.out_features
    flat = x.reshape(-1, k).contiguous()
    rows = flat.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    groups = packed.scales.shape[1]
    zeros = packed.zeros if packed.zeros is not None else packed.scales  # never read without HAS_ZEROS
    block_m = _row_block(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, BLOCK_N))
    _quantized_matmul[grid](flat, packed.weight, packed.scales, zeros, y, rows, n, k, groups, k // groups,
                            BITS=packed.bits, HAS_ZEROS=packed.zeros is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                            BLOCK_K=BLOCK_K, INT4_BLOCK=INT4_BLOCK, INT4_LANE=INT4_LANE,
                            SYMMETRIC_ZERO=float(INT4_SYMMETRIC_ZERO), ROUND_BF16=x.dtype == torch.bfloat16,
                            DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu")
    return y.view(*x.shape[:-1], n)


triton_quantized_linear = _triton_quantized_linear if triton is not None else None
