"""`linear(x, weight)` that uses the bf16 decode kernel for few-row inputs, torch otherwise."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("gemv_bf16.cpp")
KERNEL_NAME = "mili_gemv_bf16_v2"  # bump when the source changes so the JIT cache rebuilds
MAX_KERNEL_ROWS = 8  # the kernel's limit; larger batches are compute-bound and go to oneDNN
K_MULTIPLE = 32
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags


class DecodeLinearKernel:
    """Dispatches few-row bf16 CPU matmuls to the compiled kernel."""

    def __init__(self, module) -> None:
        self._gemv = module.gemv_bf16

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            rows <= MAX_KERNEL_ROWS
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.shape[-1] % K_MULTIPLE == 0
            and weight.is_contiguous()
        ):
            out = self._gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight)
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight)


@functools.lru_cache(maxsize=1)
def load_decode_linear_kernel() -> DecodeLinearKernel | None:
    """Build (once per machine, cached by torch) and load the kernel; None when it cannot be had."""
    if not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name=KERNEL_NAME, sources=[str(KERNEL_SOURCE)], extra_cflags=COMPILE_FLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, unsupported flags: fall back to torch
        logger.warning("bf16 decode kernel unavailable, using torch matmuls: %s", exc)
        return None
    return DecodeLinearKernel(module)
