"""Optional compiled CPU kernels, built on first use with torch's JIT extension builder.

Only a speed-up: when the CPU lacks AVX512-BF16, the compiler is missing or the build fails, callers
fall back to torch's own ops and results stay the same up to bf16 rounding.
"""

from mili_openai.kernels.linear import DecodeLinearKernel, load_decode_linear_kernel

__all__ = ["DecodeLinearKernel", "load_decode_linear_kernel"]
