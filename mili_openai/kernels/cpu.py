"""Loads the compiled CPU kernels and decides, per call, whether they apply."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp", "gemv_bf16.cpp", "paged_decode_attention.cpp")
EXTENSION_NAME = "mili_cpu_kernels_v3"  # bump when a source changes so torch's JIT cache rebuilds
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
MAX_GEMV_ROWS = 8  # the gemv kernel's limit; more rows are compute-bound and go to oneDNN's GEMM
GEMV_K_MULTIPLE = 32
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # the attention kernel keeps a head in registers
ATTENTION_DTYPES = (torch.bfloat16, torch.float32)


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class CpuKernels:
    """Decode-shaped CPU kernels with torch fallbacks outside their domain."""

    def __init__(self, module) -> None:
        self._module = module

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T; few-row bf16 inputs stream the weight once through the gemv kernel."""
        rows = x.numel() // x.shape[-1]
        if (
            rows <= MAX_GEMV_ROWS
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.shape[-1] % GEMV_K_MULTIPLE == 0
            and weight.is_contiguous()
        ):
            out = self._module.gemv_bf16(x.reshape(rows, x.shape[-1]).contiguous(), weight)
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight)

    @staticmethod
    def supports_decode_attention(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        return (
            q.device.type == "cpu"
            and q.dtype in ATTENTION_DTYPES
            and k_pool.dtype == q.dtype
            and q.shape[-1] in ATTENTION_HEAD_DIMS
            and k_pool.is_contiguous()
        )

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                         ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, H, D) against the pool rows at slots[b, :ctx_lens[b]] -> (B, H, D)."""
        return self._module.paged_decode_attention(q.contiguous(), k_pool, v_pool, slots, ctx_lens, scale)


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> CpuKernels | None:
    """Build (once per machine, cached by torch) and load the kernels; None when they cannot be had."""
    if not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name=EXTENSION_NAME, sources=[str(SOURCE_DIR / s) for s in SOURCES],
                      extra_cflags=COMPILE_FLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, unsupported flags: torch's ops instead
        logger.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return None
    return CpuKernels(module)
