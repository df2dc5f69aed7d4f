"""int8 activations (compressed-tensors W8A8): how a projection's input is quantized to int8 before its int8
weights multiply it, as vLLM's int8 GEMM path serves these checkpoints. The numbers (per token or with a static
scale, the rounding, the scaled integer products) live with the matmuls that run them, in kernels/quantized.py
(`Int8Inputs`, `quantize_int8_rows`, `int8_input_linear`)."""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.kernels.quantized import Int8Inputs


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

    @property
    def inputs(self) -> Int8Inputs:
        """As the matmuls take it (with the packed weights)."""
        return Int8Inputs(self.static_scale)

    def extra_repr(self) -> str:
        return "per token, dynamic" if self.static_scale is None else f"static scale {float(self.static_scale):g}"
