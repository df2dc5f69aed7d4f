"""What each decoder layer keeps per sequence between steps: its cache spec.

An attention layer keeps K/V for every token, in pages (`PagedKVSpec`); a linear-attention layer (Qwen3.5's
Gated DeltaNet) keeps a fixed-size state per sequence whatever its length (`RecurrentStateSpec`). A model
declares one spec per decoder layer (`cache_specs()`); the engine sizes one pool per kind from them (the KV
pool over the attention layers only, the state pool over the linear ones) and admits a sequence only when
both have room. vLLM v1 groups layers by `KVCacheSpec` the same way; SGLang's `HybridReqToTokenPool` pairs a
per-request state slot with the paged KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

KV_PAIR = 2  # a K and a V vector per token


@dataclass(frozen=True)
class PagedKVSpec:
    """An attention layer: a K and a V vector per token per KV head, stored in the paged pool."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return KV_PAIR * self.num_kv_heads * self.head_dim * dtype_size(dtype)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A linear-attention layer: a fixed-size state per sequence, in a slot of the state pool."""

    conv_shape: tuple[int, ...]  # per sequence, e.g. (conv_dim, conv_kernel - 1); in the model's dtype
    recurrent_shape: tuple[int, ...]  # per sequence, e.g. (num_v_heads, head_k_dim, head_v_dim); float32

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return prod(self.conv_shape) * dtype_size(dtype) + prod(self.recurrent_shape) * dtype_size(RECURRENT_DTYPE)


LayerCacheSpec = PagedKVSpec | RecurrentStateSpec
RECURRENT_DTYPE = torch.float32  # the delta rule's state accumulates over the whole sequence: fp32, as in fla


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def attention_layers(specs: Sequence[LayerCacheSpec]) -> list[int]:
    """The decoder-layer indices of the attention layers, in order."""
    return [index for index, spec in enumerate(specs) if isinstance(spec, PagedKVSpec)]


def recurrent_layers(specs: Sequence[LayerCacheSpec]) -> list[int]:
    """The decoder-layer indices of the linear-attention layers, in order."""
    return [index for index, spec in enumerate(specs) if isinstance(spec, RecurrentStateSpec)]


def has_recurrent_layers(specs: Sequence[LayerCacheSpec]) -> bool:
    return bool(recurrent_layers(specs))


@dataclass(frozen=True, slots=True)
class ModelCaches:
    """Everything a forward reads and writes besides its inputs: the paged K/V of the attention layers and
    the per-sequence states of the linear-attention layers (None where the model has no layer of the kind)."""

    # model/kv_cache.py's KVCache and model/state_cache.py's StateCache, named but not imported: both import
    # this module, and the package has no import cycle, not even under TYPE_CHECKING
    kv: KVCache | None  # noqa: F821
    state: StateCache | None = None  # noqa: F821
