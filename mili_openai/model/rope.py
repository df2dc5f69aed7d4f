"""Rotary position embeddings: inverse frequencies per rope type, and their application to q/k.

The formulas follow transformers' `modeling_rope_utils` step by step in float32 so that cos/sin are
bit-identical to the oracle's. `RotaryEmbedding` computes them for a forward's positions (shared by all
layers); `RotaryTable` keeps its rows for positions already seen, for the engine's CPU path, which
builds them on the event loop thread where each op costs more than the arithmetic.

Dynamic NTK is exact only inside the pretraining context: transformers rescales the base from the
longest sequence seen so far *in that forward call*, and the K of earlier tokens stay rotated with the
old base. That history-dependent rotation has no equivalent in a paged cache shared across requests, so
positions at or beyond `max_position_embeddings` raise NotImplementedError for rope type "dynamic".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mili_openai.model.config import ModelConfig, RopeScaling

YARN_MSCALE_SLOPE = 0.1  # attention temperature: 0.1 * mscale * ln(factor) + 1, per the YaRN paper
RAMP_SINGULARITY_GUARD = 0.001  # widen an empty yarn ramp, as transformers does


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # int64 arange then float, exactly as transformers, so the float32 powers match bit for bit
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta ** exponents)  # (dim/2,)


def _llama3_inv_freq(rope: RopeScaling, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope.rope_theta, dim)
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return YARN_MSCALE_SLOPE * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeScaling, dim: int) -> tuple[torch.Tensor, float]:
    theta, factor, original = rope.rope_theta, rope.factor, rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength completes `num_rotations` turns over the original context
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += RAMP_SINGULARITY_GUARD
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, attention_factor


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim/2,) float32 on CPU, cos/sin scale) for the config's rope type; rotary_dim is
    head_dim, or its rotated share under a partial_rotary_factor (as transformers computes it)."""
    rope, dim = config.rope, config.rotary_dim
    if rope.rope_type in ("default", "dynamic"):  # dynamic equals default inside the pretraining context
        return _default_inv_freq(rope.rope_theta, dim), 1.0
    if rope.rope_type == "linear":
        return _default_inv_freq(rope.rope_theta, dim) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise NotImplementedError(f"rope type {rope.rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for a forward's positions; `apply_rotary` rotates q/k with them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # built on CPU even when the model is built on the meta device, and moved with .to();
        # non-persistent so checkpoints need not carry it, and kept float32 whatever the weights' dtype
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dynamic_limit = config.max_position_embeddings if config.rope.rope_type == "dynamic" else None

    def _apply(self, fn, recurse=True):
        # keep inv_freq float32 through model.to(dtype): rounding it to bf16 would shift every angle
        inv_freq = self.inv_freq
        result = super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        return result

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> (cos, signed_sin), each (T, 1, head_dim) in `dtype`, broadcastable over heads.

        signed_sin is [-sin, sin] over the two halves, the form `apply_rotary` consumes.
        """
        if self.dynamic_limit is not None and int(positions.max()) >= self.dynamic_limit:
            raise NotImplementedError(
                f"dynamic NTK RoPE beyond max_position_embeddings={self.dynamic_limit} depends on each request's "
                "history in transformers and cannot be reproduced with a shared paged cache; "
                f"keep max_model_len <= {self.dynamic_limit}"
            )
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


class RotaryTable:
    """(cos, signed_sin) rows of positions [0, n), computed once by a `RotaryEmbedding` and looked up by
    each forward's positions: two index ops where computing them took eight, on the event loop thread
    that builds every step (a visible share of its CPU in a batch-1 stream). The table grows
    by doubling to cover the largest position asked for, so it stays sized to the longest context seen.

    Rows equal what `RotaryEmbedding` computes for their positions on their own: the table is computed
    in blocks of `BLOCK_POSITIONS`, small enough that torch runs each op on one thread, so cos and sin go
    through ATen's vector loop wherever a row (head_dim/2 values) fills its 32-value steps, as Qwen3's
    head_dim of 128 does. A block split across threads could end a thread's share mid-vector, where ATen
    takes the scalar libm cos/sin for the rest, which may differ in the last bit.
    """

    BLOCK_POSITIONS = 256  # x head_dim/2 values stays under ATen's parallel grain (32768)

    def __init__(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        self._rotary, self._dtype = rotary, dtype
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 on CPU, none above `max_position` -> (cos, signed_sin), (T, 1, D) each."""
        if self._cos is None or max_position >= self._cos.shape[0]:
            self._grow(max_position + 1)
        # index_select: the same rows as indexing by `positions`, through a leaner path on the loop thread
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * (0 if self._cos is None else self._cos.shape[0]), self.BLOCK_POSITIONS)
        if self._rotary.dynamic_limit is not None:  # rows past it raise; only ask for them when needed
            size = max(needed, min(size, self._rotary.dynamic_limit))
        blocks = [self._rotary(torch.arange(start, min(size, start + self.BLOCK_POSITIONS)), self._dtype)
                  for start in range(0, size, self.BLOCK_POSITIONS)]
        self._cos = torch.cat([cos for cos, _ in blocks])
        self._sin = torch.cat([sin for _, sin in blocks])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of head_dim: x (T, heads, D), cos/signed_sin (T, 1, D) -> (T, heads, D).

    transformers computes `x * cos + rotate_half(x) * sin` with rotate_half(x) = [-x2, x1]; rolling x by
    half gives [x2, x1], and the sign moved into signed_sin makes every product, sum and bf16 rounding
    identical, in four ops instead of a split, six products and a concatenation.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` on the leading cos.shape[-1] dims of each head, the rest passed through (a
    partial_rotary_factor, as transformers' apply_rotary_pos_emb for Qwen3.5 / Qwen3-Next). x (T, heads, D)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, signed_sin)
    rotated = apply_rotary(x[..., :rotary_dim], cos, signed_sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
