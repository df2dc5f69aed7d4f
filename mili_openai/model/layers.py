"""Leaf modules of Qwen3: a bias-free `Linear` whose matmul can be swapped for a faster kernel, RMSNorm
computed in float32 as transformers does, and the SwiGLU MLP with gate and up fused into one matmul."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.kernels.quantized import PackedWeights

# (x (..., in), weight (out, in)) -> (..., out); F.linear or a kernel with the same contract
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FusedOpKernel(Protocol):
    """Compiled RMSNorm, q/k norm + RoPE and SwiGLU's activation with transformers' rounding (see
    mili_openai.kernels.CpuKernels)."""

    def supports_rms_norm(self, x: torch.Tensor) -> bool: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def supports_qk_norm_rope(self, qk: torch.Tensor) -> bool: ...

    def qk_norm_rope(self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                     eps: float, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor: ...

    def supports_silu_mul(self, gate_up: torch.Tensor) -> bool: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class ResidualNormKernel(Protocol):
    """A residual add and the RMSNorm after it in one pass (the Triton kernels on CUDA): h = x + residual
    rounded as torch's add rounds it, written over x, and the norm of h with `FusedOpKernel.rms_norm`'s
    rounding."""

    def supports_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...


class Linear(nn.Module):
    """y = x @ weight.T, no bias (no Qwen3 projection has one).

    `matmul` is a plain attribute, not a submodule, so `Qwen3ForCausalLM.set_matmul` can route every
    projection through a decode kernel without touching weights or names.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.matmul: MatmulFn = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)

    @property
    def packed(self) -> PackedWeights:
        """The weight as the decode stack takes every projection's (dense: 16 bits a value)."""
        return PackedWeights(16, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the weight multiply (as transformers
    does, so bf16 results round identically)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel: FusedOpKernel | None = None  # set by Qwen3ForCausalLM.set_fused_op_kernel
        self.residual_kernel: ResidualNormKernel | None = None  # set by Qwen3ForCausalLM.set_residual_norm_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.supports_rms_norm(x):
            return self.kernel.rms_norm(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual, added into x (a layer's fresh output: no new buffer)."""
        kernel = self.residual_kernel
        if kernel is not None and kernel.supports_add_rms_norm(x, residual):
            return kernel.add_rms_norm(x, residual, self.weight, self.eps)
        hidden = x.add_(residual)
        return hidden, self(hidden)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32, returned in x's dtype (transformers' math).

    In-place on the float32 copy: each fresh multi-MB temporary costs page faults on CPU (torch's own
    rms_norm decomposes into such temporaries there).
    """
    x32 = x.to(torch.float32, copy=True)  # a copy even for float32 input: the ops below are in-place
    inv_rms = x32.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    return x32.mul_(inv_rms).to(x.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up live in one (2 * intermediate, hidden) weight, gate rows
    first, so a token reads one matrix instead of two."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.kernel: FusedOpKernel | None = None  # set by Qwen3ForCausalLM.set_fused_op_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if self.kernel is not None and self.kernel.supports_silu_mul(gate_up):
            return self.down_proj(self.kernel.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate).mul_(up))  # (T, hidden); in place on silu's fresh output
