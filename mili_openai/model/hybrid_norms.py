"""The two norms of Qwen3.5 / Qwen3-Next, rounded as transformers rounds them.

`ZeroCenteredRMSNorm` (every decoder norm, the final norm, attention's q/k norms): the stored weight w is an
offset from 1, applied as (1 + w), and the whole product is in float32 before one rounding (Gemma's form, where
Qwen3's RMSNorm rounds the normalised x before the weight multiply). Checkpoints keep w as trained: a norm
that loads Qwen3-style would scale by w (about 0) instead of 1 + w.

`GatedRMSNorm` (the Gated DeltaNet output, per value head): a plain weight (not zero-centred), then a SiLU
gate from the layer's z projection.

The backend's `zero_centered_norm` (the compiled CPU kernels) runs the zero-centred norm, and the residual add
before it, as one op with the same rounding; at decode the ten torch ops of each cost more in dispatch than in
work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.model.kernel_backend import KernelBackend, require_backend


def _normalized_float(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32 (transformers' arithmetic, op for op)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded once to x's dtype."""

    def __init__(self, dim: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.backend = require_backend(backend)  # zero_centered_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.backend.zero_centered_norm
        fused = None if kernel is None else kernel.zero_centered_rms_norm(x, self.weight, self.eps, None)
        if fused is not None:
            return fused
        return (_normalized_float(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual, added into x (a layer's fresh output: no new buffer)."""
        kernel = self.backend.zero_centered_norm
        fused = None if kernel is None else kernel.zero_centered_rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            return x, fused
        hidden = x.add_(residual)
        return hidden, self(hidden)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero-centred"


class GatedRMSNorm(nn.Module):
    """weight * rms_norm(x) (rounded to x's dtype, then the weight in it) * silu(gate) in float32, rounded once:
    x and gate (N, D), one row per (token, value head)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * _normalized_float(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gated"
