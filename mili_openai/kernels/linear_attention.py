"""What a linear-attention (Gated DeltaNet) kernel set offers, so a backend can pick one per device.

Three implementations satisfy it: `TorchLinearAttention` (kernels/gated_delta_rule.py, any device, the
reference), the compiled CPU kernels and the Triton kernels. Shapes and semantics: kernels/gated_delta_rule.py.
A set may also fuse a layer's whole decode step (`deltanet_decode`); one that does not returns None there, and
the layer runs the ops one by one (model/gated_deltanet.py: the fused op's reference).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from mili_openai.kernels import gated_delta_rule as reference


class DeltaNetDecodeWeights(NamedTuple):
    """A Gated DeltaNet layer's weights between its two projections, as the fused decode step takes them."""

    conv_weight: torch.Tensor  # (conv_dim, K)
    A_log: torch.Tensor  # (Hv,)
    dt_bias: torch.Tensor  # (Hv,)
    norm_weight: torch.Tensor  # (Dv,): the gated RMSNorm's
    norm_eps: float
    num_k_heads: int
    head_k_dim: int


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
                              weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                              longest: int | None = None) -> torch.Tensor:
        """x (T, C) in segments; each continues and leaves its window in conv_pool -> silu(conv) (T, C).
        longest: the longest segment, where the caller knows it on the host (a kernel that sizes its grid by it
        reads cu_seqlens otherwise: a device sync)."""
        ...

    def deltanet_decode(self, projected: torch.Tensor, weights: DeltaNetDecodeWeights, conv_pool: torch.Tensor,
                        state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """A layer's decode rows from in_proj's output (B, conv_dim + value_dim + 2 Hv) to out_proj's input
        (B, value_dim) in one op, both pools updated in place at `slots` (B,); None where this set has no fused
        form for these inputs."""
        ...


def no_fused_decode(projected: torch.Tensor, weights: DeltaNetDecodeWeights, conv_pool: torch.Tensor,
                    state_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """`deltanet_decode` of a kernel set without the fused form: the layer runs its ops one by one."""
    return None


class TorchLinearAttention:
    """The torch reference on any device: always correct, the fallback where no faster kernel applies."""

    gated_delta_rule_decode = staticmethod(reference.gated_delta_rule_decode)
    gated_delta_rule_prefill = staticmethod(reference.gated_delta_rule_prefill)
    causal_conv1d_decode = staticmethod(reference.causal_conv1d_decode)
    causal_conv1d_prefill = staticmethod(reference.causal_conv1d_prefill)
    deltanet_decode = staticmethod(no_fused_decode)
