"""Optional compiled CPU kernels, built on first use with torch's JIT extension builder.

Only a speed-up: when the CPU lacks AVX512, the compiler is missing or the build fails, callers
keep torch's own ops and results stay the same up to floating-point rounding.
"""

from mili_openai.kernels.cpu import (
    CpuKernels,
    build_cpu_kernels_in_background,
    cpu_kernels_built,
    cpu_supports_kernels,
    load_cpu_kernels,
)

__all__ = ["CpuKernels", "build_cpu_kernels_in_background", "cpu_kernels_built", "cpu_supports_kernels",
           "load_cpu_kernels"]
