"""What the weights and the KV cache take, and whether the cache still fits once the weights are loaded.

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
    """ValueError when a cache of `kv_bytes` exceeds what the device has free beside the loaded weights."""
    free = free_bytes(device)
    if free is not None and kv_bytes > free:
        raise ValueError(f"the KV cache ({kv_bytes / BYTES_PER_GIB:.2f} GiB) does not fit in the "
                         f"{free / BYTES_PER_GIB:.2f} GiB free on {device.type} beside the weights "
                         f"({weights / BYTES_PER_GIB:.2f} GiB): lower --kv-cache-memory-gb or --num-pages, or "
                         "quantize the weights (--quantization)")


def log_memory(weights: int, quantization: str | None, dtype: torch.dtype, kv_bytes: int, num_pages: int,
               page_size: int) -> None:
    kind = quantization or f"{str(dtype).removeprefix('torch.')}, unquantized"
    logger.info("weights %.2f GiB (%s); KV cache %.2f GiB: %d pages of %d tokens", weights / BYTES_PER_GIB, kind,
                kv_bytes / BYTES_PER_GIB, num_pages, page_size)
