"""The paged KV cache: for every layer, a K pool and a V pool of `num_pages * page_size` token slots.

A slot is `page * page_size + offset`; the engine's page bookkeeping decides which slots a sequence owns,
the model only writes new tokens' K/V at `ForwardBatch.slot_mapping` and reads contexts by slot. All
pools live in one allocation so the cache's memory is one number and one `zeros` call.
"""

from __future__ import annotations

import torch

from mili_openai.model.config import ModelConfig
from mili_openai.model.huge_pages import huge_page_zeros

KV_PAIR = 2  # a K pool and a V pool per layer


class KVCache:
    def __init__(
        self, model_config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        # Zeros, not empty: decode rows pad their context with slot 0 and mask it out, but a masked
        # position still multiplies its V by a zero weight, and 0 * NaN from uninitialised memory is NaN.
        # On CPU, huge pages: decode attention reads each sequence's pages scattered over the pool.
        shape = (model_config.num_hidden_layers, KV_PAIR, self.num_slots, model_config.num_key_value_heads,
                 model_config.head_dim)  # (layers, 2, slots, kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            # written once now, so every page is resident before the first request (as torch.zeros did):
            # a machine short of memory fails at start, and no request waits on page faults later
            self.pools = huge_page_zeros(shape, dtype).zero_()
        else:
            self.pools = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(model_config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return (model_config.num_hidden_layers * KV_PAIR * page_size * model_config.num_key_value_heads
                * model_config.head_dim * element)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool) of one layer, each a (slots, kv_heads, head_dim) view."""
        pair = self.pools[index]
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
