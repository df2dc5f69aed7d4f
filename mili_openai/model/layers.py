"""Leaf modules of Qwen3: a bias-free `Linear`, RMSNorm computed in float32 as transformers does, and the SwiGLU
MLP with gate and up fused into one matmul. Each runs its op through the model's `KernelBackend`
(model/kernel_backend.py) where it has a kernel for it, else in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.kernels.quantized import PackedWeights
from mili_openai.model.kernel_backend import KernelBackend, require_backend


class Linear(nn.Module):
    """y = x @ weight.T, no bias (no Qwen3 projection has one), through `backend.matmul`."""

    def __init__(self, in_features: int, out_features: int, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.backend = require_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.matmul(x, self.weight)

    @property
    def packed(self) -> PackedWeights:
        """The weight as the decode stack takes every projection's (dense: 16 bits a value)."""
        return PackedWeights(16, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


def embedding_table(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """`nn.Embedding(num_embeddings, embedding_dim)`, less its random init on the loader's meta device (which the
    loader replaces): there it goes through torch._refs and imports torch._dynamo (~2 s of CPU at every start)."""
    weight = torch.empty(num_embeddings, embedding_dim)
    if not weight.is_meta:  # built outside the loader (a test's module): initialised as nn.Embedding does
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the weight multiply (as transformers
    does, so bf16 results round identically)."""

    def __init__(self, dim: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = require_backend(backend)  # fused_ops, residual_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.backend.fused_ops
        if kernel is not None and kernel.supports_rms_norm(x):
            return kernel.rms_norm(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual, added into x (a layer's fresh output: no new buffer)."""
        kernel = self.backend.residual_norm
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

    def __init__(self, hidden_size: int, intermediate_size: int, backend: KernelBackend) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.backend = require_backend(backend)  # matmul, fused_ops
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, self.backend)
        self.down_proj = Linear(intermediate_size, hidden_size, self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        kernel = self.backend.fused_ops
        if kernel is not None and kernel.supports_silu_mul(gate_up):
            return self.down_proj(kernel.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate).mul_(up))  # (T, hidden); in place on silu's fresh output
