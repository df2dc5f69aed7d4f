"""Quantizing a dense weight while the model loads (`--quantization`): the numbers, not the modules.

- int8: symmetric, one scale per output row: scale = max|w| / 127, q = round(w / scale) in [-127, 127];
  |w - q * scale| <= scale / 2.
- int4: asymmetric, one float16 scale and a zero point per group of K values: the group's range, widened
  to hold 0, over 15 steps; the levels are computed against the stored (float16) scale, so
  |w - (level - zero) * scale| <= scale / 2 inside the range and <= scale at its clamped ends.
- fp8 (CUDA): e4m3, one scale per output row: scale = max|w| / 448.
"""

from __future__ import annotations

import torch

from mili_openai.kernels.fp8 import FP8_MAX
from mili_openai.kernels.quantized import PackedWeights, pack_int4

INT8_MAX = 127
INT4_MAX_LEVEL = 15
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero row or group quantizes to zeros with any scale: 1 keeps the division finite."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8(weight: torch.Tensor) -> PackedWeights:
    """(N, K) -> int8 (N, K) and float32 scales (N, 1)."""
    w = weight.float()
    scale = _nonzero(w.abs().amax(dim=1, keepdim=True) / INT8_MAX)
    q = torch.round(w / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return PackedWeights(8, q.contiguous(), scale.contiguous())


def quantize_int4(weight: torch.Tensor, group_size: int) -> PackedWeights:
    """(N, K) -> packed int4 levels, float16 scales (N, K / group_size) and uint8 zero points."""
    rows, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide a row of {k} values")
    w = weight.float().view(rows, k // group_size, group_size)
    low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    # (N, G): exactly the stored float16 (weights ~1e6 apart in a group would overflow it: clamped)
    scale = _nonzero(((high - low) / INT4_MAX_LEVEL).clamp_(max=FLOAT16_MAX).half().float())
    zero = torch.round(-low / scale).clamp_(0, INT4_MAX_LEVEL)
    levels = torch.round(w / scale[..., None] + zero[..., None]).clamp_(0, INT4_MAX_LEVEL)
    return PackedWeights(4, pack_int4(levels.view(rows, k)), scale.half().contiguous(),
                         zero.to(torch.uint8).contiguous())


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> float8_e4m3fn (N, K) and float32 scales (N,)."""
    w = weight.float()
    scale = _nonzero(w.abs().amax(dim=1) / FP8_MAX)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
