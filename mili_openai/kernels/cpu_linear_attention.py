"""Gated DeltaNet's ops on the compiled CPU kernels (csrc/gated_delta_rule_ops.h, built for AVX-512 in kernels/cpu.py
and for AVX2 in kernels/cpu_avx2.py: the same names and semantics), a `LinearAttentionKernel`.

Decode runs the fused delta-rule step (the fp32 state read and written once per token); prefill runs the same
step token by token per (segment, value head), the state staying in cache: on CPU that beats the chunked WY
form in torch several times over (scripts/bench_gated_delta_rule.py). Shapes outside the kernels' domain go to
the torch reference (kernels/gated_delta_rule.py). A layer's whole decode step, conv to gated norm, is one call
(csrc/gated_deltanet_layer.h): op by op it is some thirty small torch ops a layer.
"""

from __future__ import annotations

import torch

from mili_openai.kernels import gated_delta_rule as reference
from mili_openai.kernels.linear_attention import DeltaNetDecodeWeights

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # the kernel stages a head's q, k, v rows on the stack
VECTOR_LANES = 16  # the state's columns and the conv's channels go in whole registers (AVX-512's 16, AVX2's 8)
MAX_CONV_WIDTH = 8


def _fits_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> bool:
    return (
        all(x.device.type == "cpu" and x.dtype == v.dtype and x.stride(-1) == 1 for x in (q, k, v))
        and v.dtype in KERNEL_DTYPES
        and k.shape[-1] <= MAX_HEAD_DIM and v.shape[-1] <= MAX_HEAD_DIM and v.shape[-1] % VECTOR_LANES == 0
        and state_pool.is_contiguous()
    )


def _fits_conv(x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1
            and x.shape[-1] % VECTOR_LANES == 0 and conv_pool.dtype == x.dtype
            and conv_pool.is_contiguous() and weight.shape[-1] <= MAX_CONV_WIDTH)


def _fits_decode_layer(projected: torch.Tensor, weights: DeltaNetDecodeWeights, conv_pool: torch.Tensor,
                       state_pool: torch.Tensor) -> bool:
    dtype, head_v_dim, conv_dim = projected.dtype, weights.norm_weight.shape[-1], weights.conv_weight.shape[0]
    return (projected.device.type == "cpu" and dtype in KERNEL_DTYPES and projected.stride(-1) == 1
            and weights.norm_weight.dtype == dtype and weights.conv_weight.dtype in (dtype, torch.float32)
            and weights.conv_weight.is_contiguous() and weights.conv_weight.shape[-1] <= MAX_CONV_WIDTH
            and conv_pool.dtype == dtype and conv_pool.is_contiguous() and state_pool.is_contiguous()
            and weights.head_k_dim <= MAX_HEAD_DIM and head_v_dim <= MAX_HEAD_DIM
            and head_v_dim % VECTOR_LANES == 0 and conv_dim % VECTOR_LANES == 0)


def _float(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.float().contiguous()


class CpuLinearAttention:
    """The linear-attention ops on the compiled CPU kernels; `module` is either extension (AVX-512 or AVX2)."""

    def __init__(self, module) -> None:
        self._module = module

    def gated_delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state_pool: torch.Tensor,
                                state_slots: torch.Tensor) -> torch.Tensor:
        reference.check_heads(q, k, v, state_pool)
        if not _fits_delta_rule(q, k, v, state_pool):
            return reference.gated_delta_rule_decode(q, k, v, g, beta, state_pool, state_slots)
        return self._module.gated_delta_rule_decode(q, k, v, g.float(), beta.float(), state_pool,
                                                    state_slots.long().contiguous())

    def gated_delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                                 state_slots: torch.Tensor) -> torch.Tensor:
        reference.check_heads(q, k, v, state_pool)
        if not _fits_delta_rule(q, k, v, state_pool):
            return reference.gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots)
        return self._module.gated_delta_rule_prefill(q, k, v, g.float(), beta.float(), cu_seqlens.long().contiguous(),
                                                     state_pool, state_slots.long().contiguous())

    def causal_conv1d_decode(self, x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        if not _fits_conv(x, conv_pool, weight):
            return reference.causal_conv1d_decode(x, conv_pool, weight, bias, slots)
        return self._module.causal_conv1d_decode(x, conv_pool, _float(weight), _float(bias), slots.long().contiguous())

    def causal_conv1d_prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_pool: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                              longest: int | None = None) -> torch.Tensor:
        if not _fits_conv(x, conv_pool, weight):
            return reference.causal_conv1d_prefill(x, cu_seqlens, conv_pool, weight, bias, slots)
        return self._module.causal_conv1d_prefill(x, cu_seqlens.long().contiguous(), conv_pool, _float(weight),
                                                  _float(bias), slots.long().contiguous())

    def deltanet_decode(self, projected: torch.Tensor, weights: DeltaNetDecodeWeights, conv_pool: torch.Tensor,
                        state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        if not _fits_decode_layer(projected, weights, conv_pool, state_pool):
            return None
        return self._module.gated_deltanet_decode(projected, conv_pool, weights.conv_weight, weights.A_log,
                                                  weights.dt_bias, weights.norm_weight, weights.norm_eps,
                                                  weights.num_k_heads, weights.head_k_dim, state_pool,
                                                  slots.long().contiguous())
