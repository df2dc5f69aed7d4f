"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3.6 / Qwen3-Next, over per-sequence state slots.

Per token: one projection gives the conv's input (q, k, v channels), the output gate z, and b, a per value head.
q, k, v pass a short causal depthwise conv (kernel 4) with SiLU; the delta rule then runs per value head over
an fp32 (Dk, Dv) state with decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b)
(q and k are L2-normalised inside the op); its output passes a gated RMSNorm (gate z) and `out_proj`.

`in_proj` holds Qwen3.5's four projections stacked, rows [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a], so a
token reads one matrix; the loader builds the same rows from Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba
(model/hybrid_weights.py). A sequence's conv window and recurrent state live in slot `ForwardBatch.state_slots`
of the layer's pools (model/state_cache.py): decode rows take the recurrent step, prefill chunks the chunked
form, both continuing the slot's state and leaving it updated (kernels/gated_delta_rule.py). A kernel set with a
fused decode step (`LinearAttentionKernel.deltanet_decode`) runs a decode row's whole layer between the two
projections in one call; `_mix` is that step op by op, and its reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.kernels.linear_attention import DeltaNetDecodeWeights
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_norms import GatedRMSNorm
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.layers import Linear

BETA_AND_DECAY = 2  # in_proj's b and a rows: one of each per value head


@dataclass(frozen=True, slots=True)
class StateRows:
    """Where a forward's rows keep their state, shared by every linear layer of the step."""

    decode_slots: torch.Tensor  # (num_decode,) int64: the state slot of each decode row
    prefill_slots: torch.Tensor  # (segments,) int64: the state slot of each prefill chunk
    cu_seqlens: torch.Tensor  # (segments + 1,) int64: chunk bounds counted from the first prefill row
    num_decode: int
    # where decodes verify drafts (ForwardBatch.decode_groups): per depth t, (the decode rows that are the t-th of
    # their sequence, their slots), run one depth after another so each row continues the state its row before
    # left; None when every decode has one row
    verify_steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    longest_prefill: int | None = None  # the longest prefill chunk's tokens, known on the host (None: not given)

    @classmethod
    def of(cls, batch: ForwardBatch) -> StateRows:
        if batch.state_slots is None:
            raise ValueError("a model with linear-attention layers needs ForwardBatch.state_slots (a state slot per "
                             "decode row and prefill chunk)")
        decode = batch.num_decode
        lengths = [0] + [segment.length for segment in batch.prefills]
        if batch.state_slots.shape[0] != decode + len(batch.prefills):
            raise ValueError(f"state_slots has {batch.state_slots.shape[0]} entries for {decode} decode rows and "
                             f"{len(batch.prefills)} prefill chunks")
        device = batch.state_slots.device
        # decode-only: no copy from the host, which a CUDA graph's capture cannot take (engine/cuda_graphs.py)
        cu_seqlens = (torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(device) if batch.prefills
                      else torch.zeros(1, dtype=torch.int64, device=device))
        decode_slots = batch.state_slots[:decode]
        steps = None
        if batch.decode_groups is not None:
            starts = [0]
            for count in batch.decode_groups[:-1]:
                starts.append(starts[-1] + count)
            steps = []
            for depth in range(max(batch.decode_groups)):
                rows = torch.tensor([start + depth for start, count in zip(starts, batch.decode_groups)
                                     if count > depth], dtype=torch.int64).to(device)
                steps.append((rows, decode_slots[rows]))
        return cls(decode_slots, batch.state_slots[decode:], cu_seqlens, decode, steps, longest_prefill=max(lengths))


class ShortConv(nn.Module):
    """The depthwise causal conv's weight, (channels, kernel) (the checkpoint's (channels, 1, kernel) squeezed)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = require_backend(backend)  # linear_attention, matmul
        linear = config.hybrid.linear
        self.num_k_heads, self.num_v_heads = linear.num_key_heads, linear.num_value_heads
        self.head_k_dim, self.head_v_dim = linear.key_head_dim, linear.value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = linear.key_dim, linear.value_dim, linear.conv_dim
        self.in_proj = Linear(config.hidden_size, self.conv_dim + self.value_dim + BETA_AND_DECAY * self.num_v_heads,
                              self.backend)
        self.conv1d = ShortConv(self.conv_dim, linear.conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, self.backend)

    def forward(self, x: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor, state_pool: torch.Tensor,
                kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (T, hidden); conv_pool (slots, conv_dim, K-1); state_pool (slots, Hv, Dk, Dv) fp32 -> (T, hidden).
        kept: (conv, recurrent) buffers of one entry per decode row, where a step verifying drafts keeps the
        state each row leaves (model/state_cache.py), for the runner to roll rejected drafts back."""
        projected = self.in_proj(x)
        decode, parts = rows.num_decode, []
        if decode:
            step = self._decode_step(projected, conv_pool, state_pool)
            parts.append(_run_decode_rows(rows, step, (conv_pool, state_pool), kept))
        if rows.prefill_slots.numel():
            kernel, weight = self.backend.linear_attention, self.conv1d.weight
            cu_seqlens, slots, longest = rows.cu_seqlens, rows.prefill_slots, rows.longest_prefill
            parts.append(self._mix(
                projected[decode:],
                lambda mixed: kernel.causal_conv1d_prefill(mixed, cu_seqlens, conv_pool, weight, None, slots, longest),
                lambda q, k, v, g, beta: kernel.gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, state_pool,
                                                                         slots)))
        return self.out_proj(parts[0] if len(parts) == 1 else torch.cat(parts))

    def decode_weights(self) -> DeltaNetDecodeWeights:
        """The weights the kernels' fused decode step takes (read at each step: the loader may replace them)."""
        return DeltaNetDecodeWeights(self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
                                     self.num_k_heads, self.head_k_dim)

    def _decode_step(self, projected: torch.Tensor, conv_pool: torch.Tensor,
                     state_pool: torch.Tensor) -> Callable[[torch.Tensor | slice, torch.Tensor], torch.Tensor]:
        """`step(row index, slots)` over decode rows: the kernel's fused layer step where it has one, else the ops."""
        kernel, weight, weights = self.backend.linear_attention, self.conv1d.weight, self.decode_weights()

        def step(index: torch.Tensor | slice, slots: torch.Tensor) -> torch.Tensor:
            fused = kernel.deltanet_decode(projected[index], weights, conv_pool, state_pool, slots)
            if fused is not None:
                return fused
            return self._mix(projected[index],
                             lambda mixed: kernel.causal_conv1d_decode(mixed, conv_pool, weight, None, slots),
                             lambda q, k, v, g, beta: kernel.gated_delta_rule_decode(q, k, v, g, beta, state_pool,
                                                                                     slots))
        return step

    def _mix(self, projected: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor],
             delta_rule: Callable[..., torch.Tensor]) -> torch.Tensor:
        """in_proj's output (T, ...) -> out_proj's input (T, value_dim) op by op, `conv` and `delta_rule` running
        over the rows' state slots: the reference of the kernels' fused decode step (deltanet_decode)."""
        tokens = projected.shape[0]
        mixed, z, b, a = projected.split((self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads), dim=-1)
        q, k, v = conv(mixed).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)  # (T, conv_dim) split
        q = q.view(tokens, self.num_k_heads, self.head_k_dim)
        k = k.view(tokens, self.num_k_heads, self.head_k_dim)
        v = v.view(tokens, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()  # (T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (T, Hv) float32
        out = delta_rule(q, k, v, g, beta)  # (T, Hv, Dv)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return out.view(tokens, self.value_dim)


def _run_decode_rows(rows: StateRows, step: Callable[[torch.Tensor | slice, torch.Tensor], torch.Tensor],
                     pools: tuple[torch.Tensor, torch.Tensor],
                     kept: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`step(row index, slots)` over the decode rows: all at once, or where decodes verify drafts one depth at
    a time (each sequence's rows in order over its one slot), copying the (conv, recurrent) state each row leaves
    into `kept`."""
    if rows.verify_steps is None:
        return step(slice(0, rows.num_decode), rows.decode_slots)
    out = None
    for depth_rows, slots in rows.verify_steps:
        result = step(depth_rows, slots)
        if out is None:
            out = result.new_empty((rows.num_decode, *result.shape[1:]))
        out[depth_rows] = result
        if kept is not None:
            for pool, buffer in zip(pools, kept):
                buffer[depth_rows] = pool[slots]
    return out
