"""What a linear-attention (Gated DeltaNet) kernel set offers, so a backend can pick one per device.

Three implementations satisfy it: `TorchLinearAttention` (kernels/gated_delta_rule.py, any device, the
reference), the compiled CPU kernels and the Triton kernels. Shapes and semantics: kernels/gated_delta_rule.py.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from mili_openai.kernels import gated_delta_rule as reference


@runtime_checkable
class LinearAttentionKernel(Protocol):
    def gated_delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state_pool: torch.Tensor,
                                state_slots: torch.Tensor) -> torch.Tensor:
        """q, k (B, Hk, Dk) raw; v (B, Hv, Dv); g, beta (B, Hv); state_pool (slots, Hv, Dk, Dv) fp32, rows
        `state_slots` (B,) updated in place -> (B, Hv, Dv) in v's dtype."""
        ...

    def gated_delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                                 state_slots: torch.Tensor) -> torch.Tensor:
        """q, k (T, Hk, Dk) raw; v (T, Hv, Dv); g, beta (T, Hv); cu_seqlens (S + 1,) int64; segment s continues
        state_pool[state_slots[s]] and writes its final state back -> (T, Hv, Dv) in v's dtype."""
        ...

    def causal_conv1d_decode(self, x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        """x (B, C); conv_pool (slots, C, K-1) windows shifted in place; weight (C, K) -> silu(conv) (B, C)."""
        ...

    def causal_conv1d_prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_pool: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        """x (T, C) in segments; each continues and leaves its window in conv_pool -> silu(conv) (T, C)."""
        ...


class TorchLinearAttention:
    """The torch reference on any device: always correct, the fallback where no faster kernel applies."""

    gated_delta_rule_decode = staticmethod(reference.gated_delta_rule_decode)
    gated_delta_rule_prefill = staticmethod(reference.gated_delta_rule_prefill)
    causal_conv1d_decode = staticmethod(reference.causal_conv1d_decode)
    causal_conv1d_prefill = staticmethod(reference.causal_conv1d_prefill)
