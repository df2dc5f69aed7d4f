"""bf16 matmuls and Gated DeltaNet's ops on CPUs with AVX2, FMA and F16C but no AVX-512 (csrc_avx2/), where the
full kernel set (kernels/cpu.py) cannot run: Zen 2 / Zen 3 EPYCs, older Xeons and many cloud VMs.

There torch's bf16 GEMM multiplies at a few GFLOP/s and oneDNN has no bf16 path, so a bf16 model's every
projection crawls. A decode step's few rows go through one kernel (bf16 weights widened in registers, so the
weights stream once); more rows through a GEMM on panels of widened weights (csrc_avx2/gemm_bf16_avx2.cpp), or
torch's fp32 GEMM on widened operands where the timed plan finds that faster, as `CpuKernels.linear` splits
them.

`biased_linear`: a vision tower's projections (fp32 here, see model/backend_setup.py) as one fp32 GEMM with the
bias and the tanh GELU fused, on weights packed once (csrc_avx2/gemm_f32_avx2.cpp), in oneDNN's place.

`linear_attention`: the AVX-512 set's five Gated DeltaNet ops (the same names, signatures and templates, from
csrc/'s shared headers, on 8-lane registers), wrapped as there by `CpuLinearAttention`: the fp32 state read and
written once per token instead of torch's several passes. Norms and attention stay torch's.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mili_openai.kernels.build_lock import build_directory, compile_extension, extension_name
from mili_openai.kernels.cpu_linear_attention import CpuLinearAttention
from mili_openai.kernels.onednn_linear import weight_key
from mili_openai.kernels.plan_cache import kernel_plan
from mili_openai.kernels.planning import KernelPlan, linear_by_rows, linear_via_fp32, plan_matmuls

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc_avx2")
SOURCES = ("linear_bf16_avx2.cpp", "gemm_bf16_avx2.cpp", "gemm_f32_avx2.cpp", "gated_deltanet_avx2.cpp")
# csrc/ headers the sources include (vector-width-free templates): hashed into the build's name with csrc_avx2/'s
SHARED_HEADERS = tuple(SOURCE_DIR.parent / "csrc" / name for name in (
    "gated_deltanet_common.h", "gated_delta_rule_ops.h", "gated_deltanet_layer.h"))
EXTENSION_PREFIX = "mili_cpu_avx2_kernels"
COMPILE_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]  # F16C: fp16 activations widen in registers
LINK_FLAGS = ["-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
VECTOR_LANES = 16  # bf16 weights per 256-bit load: K must be a multiple


def cpu_supports_avx2_kernels(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        flags = cpuinfo.read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in REQUIRED_CPU_FLAGS)


def avx2_kernels_built() -> bool:
    """Whether loading the kernels takes a moment rather than a compile: built for this checkout's sources, or
    this CPU cannot run them."""
    if not cpu_supports_avx2_kernels():
        return True
    name = extension_name(EXTENSION_PREFIX, SOURCE_DIR, SHARED_HEADERS)
    return (build_directory(name, SOURCE_DIR) / f"{name}.so").is_file()


@dataclass(frozen=True, slots=True)
class PanelLinear:
    """A weight packed into the GEMM's panels, its bias padded to them, and which tensor it was packed from."""

    panels: torch.Tensor  # (ceil(N / 16), K, 16) fp32
    bias: torch.Tensor  # (ceil(N / 16) * 16,) fp32, zeros past N
    out_features: int
    source: tuple[int, torch.dtype, tuple[int, ...]]  # the plain weight's (data_ptr, dtype, shape)


class Avx2BiasedLinear:
    """`BiasedLinearKernel` (model/kernel_backend.py) for fp32 inputs: activation(x @ W.T + b) in one call."""

    def __init__(self, module) -> None:
        self._module = module

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
                and x.dim() == 2 and weight.dim() == 2)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PanelLinear:
        panels = self._module.pack_f32_panels(weight.detach())
        padded = torch.zeros(panels.shape[0] * panels.shape[2])
        if bias is not None:
            padded[: weight.shape[0]] = bias.detach()
        return PanelLinear(panels, padded, weight.shape[0], weight_key(weight))

    def linear(self, x: torch.Tensor, packed: PanelLinear, activation: str | None = None) -> torch.Tensor:
        """activation(x @ weight.T + bias): None, "gelu_pytorch_tanh" (fused) or "gelu" (the exact one, after)."""
        if activation not in (None, "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"no activation {activation!r} here")
        out = self._module.biased_gemm_f32_avx2(x, packed.panels, packed.bias, packed.out_features,
                                                activation == "gelu_pytorch_tanh")
        return F.gelu(out) if activation == "gelu" else out


class Avx2Kernels:
    """`linear` for bf16 weights, `biased_linear` for a vision tower's fp32 projections and `linear_attention` (any
    of its dtypes); the extension is `module`."""

    def __init__(self, module) -> None:
        self._module = module
        self.linear_attention = CpuLinearAttention(module)  # a LinearAttentionKernel (kernels/linear_attention.py)
        self.biased_linear = Avx2BiasedLinear(module)
        self.plan = KernelPlan()
        self.planned = False  # whether `plan` was chosen (timed or read from the plan cache)

    def _kernel_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._module.linear_bf16_avx2(x, weight)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for many bf16 rows, on panels of widened weights (csrc_avx2/gemm_bf16_avx2.cpp)."""
        return self._module.gemm_bf16_avx2(x, weight)

    def own_matmuls(self) -> dict:
        """The GEMMs of this set a plan may choose, by the name its file keeps (plan_cache.plan_to_json)."""
        return {"gemm_bf16_avx2": self.gemm}

    def timed_plan(self) -> KernelPlan:
        """Rows up to which the kernel beats the GEMM for more, and which GEMM that is (this set's, or torch's on
        widened operands): seconds, on this CPU."""
        max_rows, large_matmul = plan_matmuls(self._kernel_matmul, gemms=(self.gemm, linear_via_fp32))
        return KernelPlan(max_rows, large_matmul)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T; few-row bf16 inputs stream the weight once through the kernel."""
        return linear_by_rows(x, weight, self._kernel_matmul, self.plan, VECTOR_LANES)


def load_avx2_kernels(plan_cache: bool = True) -> Avx2Kernels | None:
    """Build (once per machine and checkout, ~1 min), load and plan the kernels; None where this CPU lacks AVX2,
    FMA or F16C or the build fails. `plan_cache`: as `load_cpu_kernels`."""
    kernels = compiled_avx2_kernels()
    if kernels is None or kernels.planned:
        return kernels
    name = extension_name(EXTENSION_PREFIX, SOURCE_DIR, SHARED_HEADERS)
    kernels.plan = kernel_plan(build_directory(name, SOURCE_DIR), name, kernels.timed_plan, plan_cache,
                               kernels.own_matmuls())
    kernels.planned = True
    logger.info("AVX2 CPU kernels: bf16 matmuls of up to %d rows (more: %s)", kernels.plan.max_kernel_rows,
                kernels.plan.large_matmul.__name__)
    return kernels


@functools.lru_cache(maxsize=1)
def compiled_avx2_kernels() -> Avx2Kernels | None:
    """The built and loaded kernels, not planned (`load_avx2_kernels` plans them); None as there."""
    if not cpu_supports_avx2_kernels():
        return None
    start = time.monotonic()
    module = compile_extension(EXTENSION_PREFIX, SOURCE_DIR, SOURCES, COMPILE_FLAGS, LINK_FLAGS, SHARED_HEADERS)
    if module is None:
        return None
    logger.info("AVX2 CPU kernels loaded in %.1f s (a first start compiles them)", time.monotonic() - start)
    return Avx2Kernels(module)
