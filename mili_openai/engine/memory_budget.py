"""What the weights and the caches take, and whether the caches still fit once the weights are loaded.

The cache budget (`--kv-cache-memory-gb`, or on CUDA what the memory profile leaves) holds one pool per kind
of layer cache (model/cache_spec.py): the state pool of the linear-attention layers first, one slot per
sequence the scheduler may run (`max_num_seqs`, as SGLang sizes its Mamba pool from its running requests),
then, for a model with linear-attention layers and prefix caching on, the prefix cache's state snapshots
(`hybrid_snapshot_fraction` of the budget, or `num_hybrid_snapshots`: extra slots of the same pool,
engine/state_snapshots.py; by default two per running sequence, see `snapshots_in_budget`), then KV pages for the attention layers in the rest. A model without
linear-attention layers has no state pool.

Quantized weights leave room for a larger cache: on CUDA the pool is sized from the memory left after the
weights (memory_profile.py); an explicit `--kv-cache-memory-gb` is checked against the memory free after
them, so it may grow by what `--quantization` saved. A cache that does not fit is
refused at start with both sizes, rather than failing on an out-of-memory error mid-allocation (or, on CPU,
with the kernel's OOM killer).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mili_openai.engine.memory_profile import BYTES_PER_GIB

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
MEMINFO_AVAILABLE = "MemAvailable:"
MEMINFO_UNIT = 1024  # /proc/meminfo counts kB


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, shared ones (a tied embedding) once."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def free_bytes(device: torch.device) -> int | None:
    """Memory free now on the device (CUDA: the driver's count; CPU: the kernel's MemAvailable), or None
    where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(MEMINFO_AVAILABLE):
                return int(line.split()[1]) * MEMINFO_UNIT
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_kv_cache_fits(kv_bytes: int, weights: int, device: torch.device) -> None:
    """ValueError when caches of `kv_bytes` (KV pages and state slots) exceed what the device has free beside
    the loaded weights."""
    free = free_bytes(device)
    if free is not None and kv_bytes > free:
        raise ValueError(f"the KV cache ({kv_bytes / BYTES_PER_GIB:.2f} GiB) does not fit in the "
                         f"{free / BYTES_PER_GIB:.2f} GiB free on {device.type} beside the weights "
                         f"({weights / BYTES_PER_GIB:.2f} GiB): lower --kv-cache-memory-gb or --num-pages, or "
                         "quantize the weights (--quantization)")


def pages_beside_states(budget: int, bytes_per_page: int, state_bytes: int, what: str) -> int:
    """KV pages that fit in `budget` bytes beside a state pool of `state_bytes`; ValueError naming `what` set
    the budget when not even one page does."""
    num_pages = (budget - state_bytes) // bytes_per_page
    if num_pages < 1:
        states = f" beside the state pool ({state_bytes} bytes)" if state_bytes else ""
        raise ValueError(f"{what} leaves no room for one KV page of {bytes_per_page} bytes{states}")
    return num_pages


# The default snapshot memory of a hybrid model's prefix cache: at least this share of the cache budget, and
DEFAULT_SNAPSHOT_FRACTION = 0.2
# room for this many snapshots per sequence the scheduler may run (one it holds while decoding, one its last turn
# left for its next: with fewer, 16 chats whose turns drift apart evict each other's, in a step simulation), while
SNAPSHOTS_PER_SEQUENCE = 2
# they take at most this share of what the running sequences' slots leave: the KV pages keep the rest
MAX_SNAPSHOT_SHARE = 0.5


def snapshots_in_budget(budget: int, slot_bytes: int, fraction: float | None, count: int | None,
                        num_running_slots: int) -> int:
    """State snapshots of a hybrid model's prefix cache, in slots of `slot_bytes` each beside `num_running_slots`
    running ones: `count` where given, else `fraction` of `budget` bytes; by default (both None)
    SNAPSHOTS_PER_SEQUENCE per running slot within MAX_SNAPSHOT_SHARE of what those leave, and never fewer than
    DEFAULT_SNAPSHOT_FRACTION of the budget holds."""
    if count is not None:
        return count
    if fraction is not None:
        return int(fraction * budget) // slot_bytes
    floor = int(DEFAULT_SNAPSHOT_FRACTION * budget) // slot_bytes
    room = int(MAX_SNAPSHOT_SHARE * max(0, budget - num_running_slots * slot_bytes)) // slot_bytes
    return max(floor, min(SNAPSHOTS_PER_SEQUENCE * num_running_slots, room))


def log_memory(weights: int, quantization: str | None, dtype: torch.dtype, kv_bytes: int, num_pages: int,
               page_size: int, state_bytes: int = 0, num_state_slots: int = 0, num_snapshots: int = 0) -> None:
    kind = quantization or f"{str(dtype).removeprefix('torch.')}, unquantized"
    states = (f"; state pool {state_bytes / BYTES_PER_GIB:.2f} GiB: {num_state_slots} sequence slots"
              if num_state_slots else "")
    if num_state_slots:
        per_slot = state_bytes / (num_state_slots + num_snapshots)
        states += (f" + {num_snapshots} prefix-cache snapshots ({num_snapshots * per_slot / BYTES_PER_GIB:.2f} GiB)"
                   if num_snapshots else ", no prefix-cache snapshots: prefix caching off")
    logger.info("weights %.2f GiB (%s); KV cache %.2f GiB: %d pages of %d tokens%s", weights / BYTES_PER_GIB, kind,
                kv_bytes / BYTES_PER_GIB, num_pages, page_size, states)
