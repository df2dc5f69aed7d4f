"""RMSNorm (alone, or after a residual add), q/k norm + RoPE and SwiGLU's activation for CUDA in Triton,
one launch each.

The torch forms of these (model/layers.py, model/rope.py) are six to fourteen small kernels apiece; a
decode step of Qwen3-0.6B ran about a thousand of them, which made both the GPU's time and a CUDA graph's
launch grow with the count rather than with the bytes. Each kernel here reads its rows once and keeps the
torch forms' roundings: normalised in float32, rounded to the activations' dtype before the weight
multiply, and every product and sum of the rotation rounded as torch's ops round it. Under Triton's
interpreter (TRITON_INTERPRET=1, CPU tensors) the float32 -> bf16 conversion truncates, so bf16 rounding
is done in integer ops, to the nearest value with ties to even, as torch's conversion does.

`TritonFusedOps` follows `FusedOpKernel` and `ResidualNormKernel` (model/layers.py); where Triton cannot be
imported, `TritonFusedOps` is None and the torch forms stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch forms stay
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 16384  # widest row one program normalises in registers (Qwen3's largest hidden size is 8192)


@dataclass(frozen=True, slots=True)
class FusedOpsConfig:
    """The fused ops' launch constants (scripts/tune_gpu_kernels.py times the alternatives)."""

    silu_block: int = 1024  # activation columns per program
    silu_warps: int = 4
    # q/k norm + RoPE: (token, head) rows per program, so that a program holds about this many elements: a
    # program per row (256 bytes at bf16 head_dim 128) left the GPU scheduling programs rather than moving bytes
    qk_rope_elements: int = 4096
    qk_rope_warps: int = 4
    # a norm's warps for rows of up to `norm_wide_row` elements, and twice as many for wider ones
    norm_warps: int = 4
    norm_wide_row: int = 2048


if triton is not None:

    @triton.jit
    def _rounded(x, ROUND_BF16: tl.constexpr, DTYPE: tl.constexpr):
        """float32 x rounded to the activations' dtype, kept as float32."""
        if ROUND_BF16:
            bits = x.to(tl.uint32, bitcast=True)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _rounded(_rounded(x * inv_rms, ROUND_BF16, dtype) * w, ROUND_BF16, dtype)
        tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_out, n, eps,
                             BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        """h = x + r, rounded as torch's add rounds it, written over x; then out = RMSNorm(h)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = _rounded(x + r, ROUND_BF16, dtype)
        tl.store(x_ptr + row * stride_x + offs, h.to(dtype), mask=mask)
        inv_rms = tl.math.rsqrt(tl.sum(h * h, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _rounded(_rounded(h * inv_rms, ROUND_BF16, dtype) * w, ROUND_BF16, dtype)
        tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)

    @triton.jit(do_not_specialize=["num_rows"])
    def _qk_norm_rope_kernel(qk_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, num_rows, stride_qt, stride_qh,
                             stride_cos, stride_sin, stride_ot, stride_oh, eps, HEADS: tl.constexpr,
                             NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                             ROUND_BF16: tl.constexpr):
        """BLOCK_ROWS (token, head) rows, token-major, per program; each row's two halves of head_dim are
        loaded apart, so the rotation's partner of an element is the same lane of the other half."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = (rows < num_rows)[:, None]
        token, head = rows // HEADS, rows % HEADS
        dtype = out_ptr.dtype.element_ty
        half = tl.arange(0, HEAD_DIM // 2)[None, :]
        first = qk_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + half  # (BLOCK_ROWS, D/2)
        x1 = tl.load(first, mask=row_ok, other=0.0).to(tl.float32)
        x2 = tl.load(first + HEAD_DIM // 2, mask=row_ok, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / HEAD_DIM + eps)[:, None]
        is_q = (head < NUM_Q_HEADS)[:, None]
        second = half + HEAD_DIM // 2
        w1 = tl.where(is_q, tl.load(qw_ptr + half), tl.load(kw_ptr + half)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + second), tl.load(kw_ptr + second)).to(tl.float32)
        normed1 = _rounded(_rounded(x1 * inv_rms, ROUND_BF16, dtype) * w1, ROUND_BF16, dtype)
        normed2 = _rounded(_rounded(x2 * inv_rms, ROUND_BF16, dtype) * w2, ROUND_BF16, dtype)
        cos = cos_ptr + token[:, None] * stride_cos + half
        sin = sin_ptr + token[:, None] * stride_sin + half
        cos1 = tl.load(cos, mask=row_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos + HEAD_DIM // 2, mask=row_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin, mask=row_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin + HEAD_DIM // 2, mask=row_ok, other=0.0).to(tl.float32)
        # x * cos + roll(x, D/2) * signed_sin (model/rope.py): the first half's partner is the second, and back
        y1 = _rounded(_rounded(normed1 * cos1, ROUND_BF16, dtype) + _rounded(normed2 * sin1, ROUND_BF16, dtype),
                      ROUND_BF16, dtype)
        y2 = _rounded(_rounded(normed2 * cos2, ROUND_BF16, dtype) + _rounded(normed1 * sin2, ROUND_BF16, dtype),
                      ROUND_BF16, dtype)
        out = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + half
        tl.store(out, y1.to(dtype), mask=row_ok)
        tl.store(out + HEAD_DIM // 2, y2.to(dtype), mask=row_ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_in + n + offs, mask=mask, other=0.0).to(tl.float32)
        silu = _rounded(gate / (1.0 + tl.exp(-gate)), ROUND_BF16, dtype)
        tl.store(out_ptr + row * stride_out + offs, _rounded(silu * up, ROUND_BF16, dtype).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim) with unit stride along the last dim."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class _TritonFusedOps:
    """The `FusedOpKernel` and `ResidualNormKernel` of the CUDA path (model/layers.py): each op one launch
    over all its rows."""

    def __init__(self, config: FusedOpsConfig = FusedOpsConfig()) -> None:
        # The interpreter runs on CPU tensors, the compiled kernels on CUDA ones.
        interpreted = type(_rms_norm_kernel).__name__ == "InterpretedFunction"
        self.device_type = "cpu" if interpreted else "cuda"
        self.config = config

    def _norm_warps(self, block: int) -> int:
        return self.config.norm_warps * (1 if block <= self.config.norm_wide_row else 2)

    def _supports(self, x: torch.Tensor) -> bool:
        return x.device.type == self.device_type and x.dtype in DTYPES and x.numel() > 0

    def supports_rms_norm(self, x: torch.Tensor) -> bool:
        return self._supports(x) and x.shape[-1] <= MAX_ROW

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x / rms(x)) over the last dim, with transformers' roundings."""
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        width = rows.shape[1]
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.to(x.dtype).contiguous(), out, rows.stride(0), out.stride(0),
                                           width, eps, BLOCK=block, ROUND_BF16=x.dtype == torch.bfloat16,
                                           num_warps=self._norm_warps(block))
        return out.view(x.shape)

    def supports_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (self.supports_rms_norm(x) and residual.dtype == x.dtype and residual.shape == x.shape
                and residual.device == x.device and x.is_contiguous())  # h is written over x's rows

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, weight * (h / rms(h))) for h = x + residual, h written over x (as `x.add_(residual)` would)."""
        rows, residual_rows = x.view(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        width = rows.shape[1]
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight.to(x.dtype).contiguous(), out, rows.stride(0), residual_rows.stride(0),
            out.stride(0), width, eps, BLOCK=block, ROUND_BF16=x.dtype == torch.bfloat16,
            num_warps=self._norm_warps(block))
        return x, out.view(x.shape)

    def supports_qk_norm_rope(self, qk: torch.Tensor) -> bool:
        head_dim = qk.shape[-1]
        return (self._supports(qk) and qk.dim() == 3 and qk.stride(-1) == 1 and head_dim % 2 == 0
                and head_dim == triton.next_power_of_2(head_dim) and head_dim <= 512)

    def qk_norm_rope(self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                     eps: float, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """qk (T, Hq + Hk, D): q heads normalised by q_weight, k heads by k_weight, then rotated by cos and
        signed_sin ((T, 1, D) each, model/rope.py's `apply_rotary`)."""
        tokens, heads, head_dim = qk.shape
        out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
        cos, signed_sin = _rows(cos.reshape(tokens, head_dim)), _rows(signed_sin.reshape(tokens, head_dim))
        block_rows = max(1, self.config.qk_rope_elements // head_dim)
        _qk_norm_rope_kernel[(triton.cdiv(tokens * heads, block_rows),)](
            qk, q_weight.to(qk.dtype).contiguous(), k_weight.to(qk.dtype).contiguous(), cos, signed_sin, out,
            tokens * heads, qk.stride(0), qk.stride(1), cos.stride(0), signed_sin.stride(0), out.stride(0),
            out.stride(1), eps, HEADS=heads, NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_ROWS=block_rows,
            ROUND_BF16=qk.dtype == torch.bfloat16, num_warps=self.config.qk_rope_warps)
        return out

    def supports_silu_mul(self, gate_up: torch.Tensor) -> bool:
        return self._supports(gate_up) and gate_up.shape[-1] % 2 == 0

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(..., 2I) with gate first -> silu(gate) * up, (..., I), each rounded as torch rounds it."""
        rows = _rows(gate_up)
        width = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
        block = self.config.silu_block
        grid = (rows.shape[0], triton.cdiv(width, block))
        _silu_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), width, BLOCK=block,
                               ROUND_BF16=gate_up.dtype == torch.bfloat16, num_warps=self.config.silu_warps)
        return out.view(*gate_up.shape[:-1], width)


TritonFusedOps = _TritonFusedOps if triton is not None else None
