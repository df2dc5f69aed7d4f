"""The paged KV cache: for every attention layer, a K pool and a V pool of `num_pages * page_size` token slots.

A slot is `page * page_size + offset`; the engine's page bookkeeping decides which slots a sequence owns,
the model only writes new tokens' K/V at `ForwardBatch.slot_mapping` and reads contexts by slot. All
pools live in one allocation so the cache's memory is one number and one `zeros` call. Only the layers
whose cache spec is `PagedKVSpec` get pools (model/cache_spec.py); `layer(i)` takes the decoder-layer index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili_openai.model.cache_spec import KV_PAIR, LayerCacheSpec, PagedKVSpec, attention_layers
from mili_openai.model.huge_pages import huge_page_zeros


def _attention_spec(specs: Sequence[LayerCacheSpec]) -> tuple[list[int], PagedKVSpec]:
    """(the attention layers' decoder indices, their one spec): the pools are one tensor, so every
    attention layer must keep K/V of the same shape."""
    layers = attention_layers(specs)
    if not layers:
        raise ValueError("a KV cache needs at least one attention layer (PagedKVSpec)")
    shapes = {specs[index] for index in layers}
    if len(shapes) > 1:
        raise ValueError(f"attention layers with different K/V shapes are not supported: {sorted(map(str, shapes))}")
    return layers, specs[layers[0]]


class KVCache:
    def __init__(self, specs: Sequence[LayerCacheSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """specs: the model's cache spec per decoder layer (`cache_specs()`); pools for its attention layers."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        layers, spec = _attention_spec(specs)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self._pool_of_layer = {decoder_index: pool for pool, decoder_index in enumerate(layers)}
        # Zeros, not empty: decode rows pad their context with slot 0 and mask it out, but a masked
        # position still multiplies its V by a zero weight, and 0 * NaN from uninitialised memory is NaN.
        # On CPU, huge pages: decode attention reads each sequence's pages scattered over the pool.
        shape = (len(layers), KV_PAIR, self.num_slots, spec.num_kv_heads,
                 spec.head_dim)  # (attention layers, 2, slots, kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            # written once now, so every page is resident before the first request (as torch.zeros did):
            # a machine short of memory fails at start, and no request waits on page faults later
            self.pools = huge_page_zeros(shape, dtype).zero_()
        else:
            self.pools = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(specs: Sequence[LayerCacheSpec], page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page takes across all attention layers, K and V."""
        layers, spec = _attention_spec(specs)
        return len(layers) * page_size * spec.bytes_per_token(dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool) of decoder layer `index` (an attention layer), each a (slots, kv_heads, head_dim) view."""
        pool = self._pool_of_layer.get(index)
        if pool is None:
            raise ValueError(f"decoder layer {index} is not an attention layer: it keeps no K/V pages")
        pair = self.pools[pool]
        return pair[0], pair[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.pools.dtype

    @property
    def device(self) -> torch.device:
        return self.pools.device

    @property
    def nbytes(self) -> int:
        return self.pools.numel() * self.pools.element_size()
