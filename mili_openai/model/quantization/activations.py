"""int8 activations (compressed-tensors W8A8): each projection's input quantized to int8 before its int8
weights multiply it, as vLLM's int8 GEMM path serves these checkpoints.

Per token m (a row of x), with scale s_m:
- dynamic per token: s_m = max|x_m| / 127 and q_m = round(x_m * (127 / max|x_m|)), vLLM's form (a reciprocal
  multiplied in, not a division); a row of zeros quantizes to zeros;
- static per tensor: s_m = the checkpoint's `input_scale` for every token, q_m = round(x_m / s).
Rounding is half to even (torch.round, as vLLM's and compressed-tensors' kernels round) and q is clamped to
int8's [-128, 127] (only a static scale can reach the ends). y = s_m * (q_m . W), W the dequantized weight:
the products q * w_q add up exactly as integers and s_m * s_w scales the sum, as vLLM's scaled int8 GEMM does.

The kernels take the integers q in x's dtype (exact in bf16 and float32: |q| <= 128), so the int8 matmuls
of kernels/quantized.py, compiled or Triton, run W8A8 unchanged; the rows of their output are then scaled.
"""

from __future__ import annotations

import torch
from torch import nn

INT8_MIN, INT8_MAX = -128, 127


def quantize_int8_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (q (..., K) in x's dtype holding integers in [-128, 127], float32 scales (..., 1) or the
    static scale (1,)): x ~ q * scale, row by row."""
    values = x.float()
    if static_scale is None:
        amax = values.abs().amax(dim=-1, keepdim=True)  # (..., 1)
        scale = amax / INT8_MAX
        inverse = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
        levels = torch.round(values * inverse)
    else:
        scale = static_scale
        levels = torch.round(values / scale)
    return levels.clamp_(INT8_MIN, INT8_MAX).to(x.dtype), scale


class Int8Activations(nn.Module):
    """How a W8A8 projection quantizes its input: per token from each row's range (`static_scale` None), or
    with the checkpoint's one scale (a frozen parameter, so it moves with the model)."""

    def __init__(self, static_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        if static_scale is not None and not (static_scale.numel() == 1 and bool(torch.isfinite(static_scale).all())
                                             and float(static_scale) > 0):
            raise ValueError(f"a static int8 activation scale is one positive finite value, got {static_scale}")
        self.static_scale = (None if static_scale is None
                             else nn.Parameter(static_scale.float().reshape(1), requires_grad=False))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_rows(x, self.static_scale)

    def extra_repr(self) -> str:
        return "per token, dynamic" if self.static_scale is None else f"static scale {float(self.static_scale):g}"
