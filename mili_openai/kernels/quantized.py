"""Quantized weights as the kernels take them, their torch reference, and the CPU matmul over them.

One layout serves the CPU kernels (csrc/linear_int8.cpp, csrc/linear_int4.cpp), the Triton ones
(kernels/triton_quantized.py) and the torch fallback:

- int8: `weight` int8 (N, K); `scales` float32 (N, G): weight[n, k] = q * scales[n, k // (K / G)], G = 1
  for one scale per output row. Symmetric: no zero point.
- int4: `weight` uint8 (N, K / 2), K a multiple of 128: each 128 values of a row take 64 bytes, read as 32
  little-endian 16-bit words, word j holding values j, 32 + j, 64 + j and 96 + j in its nibbles from low
  to high (so a kernel gets 32 values in order with one shift and one mask); `scales` float16 (N, G);
  `zeros` uint8 (N, G) or None for 8 everywhere: weight[n, k] = (q - zero) * scale of the group, groups
  of 32, 64 or a multiple of 128 values.

The dequantized weight in a dtype is the float32 product rounded once to it: what the CPU kernels
dequantize to in bf16 (the prefill GEMM's weights), and the weights the transformers oracle is given in tests.
Their decode matmuls for int8 with one scale a row and int4 with groups of whole blocks multiply the
float32 products themselves (a scale applied to a sum), not their bf16 rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mili_openai.kernels.planning import linear_via_fp32

INT8_KERNEL_GROUP = 32  # the int8 kernel takes rows (or groups) of a multiple of this many values
INT4_BLOCK = 128  # values per 64 packed bytes
INT4_LANE = 32  # values a register takes from one nibble of each of 32 words
INT4_GROUPS = (32, 64)  # group sizes below a block; larger ones are whole blocks
INT4_SYMMETRIC_ZERO = 8
NIBBLE = 0x0F
# bf16 bytes of the weight rows a thread dequantizes at once for a GEMM over many rows of x (a prefill
# chunk): half a Zen 5 core's L2, so that the slice and the GEMM's packed copy of it stay there between
# being written and read, rather than the whole dequantized weight going to memory and back
# (docs/performance.md).
GEMM_SLICE_BYTES = 512 << 10


class PackedWeights(NamedTuple):
    """A projection's weight in the layout above; `bits` 16 is a dense weight in the model's dtype."""

    bits: int  # 16, 8 or 4
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * (2 if self.bits == 4 else 1)


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """(N, K) levels 0..15 (any integer dtype) -> (N, K / 2) uint8 in the int4 layout."""
    rows, k = levels.shape
    if k % INT4_BLOCK:
        raise ValueError(f"int4 weights need K a multiple of {INT4_BLOCK}, got {k}")
    nibbles = levels.to(torch.int32).view(rows, k // INT4_BLOCK, 4, INT4_LANE)  # (N, blocks, nibble, word)
    words = nibbles[:, :, 0] | nibbles[:, :, 1] << 4 | nibbles[:, :, 2] << 8 | nibbles[:, :, 3] << 12
    low_high = torch.stack([words & 0xFF, words >> 8], dim=-1)  # little-endian bytes of each word
    return low_high.to(torch.uint8).reshape(rows, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) uint8 in the int4 layout -> (N, K) uint8 levels 0..15."""
    rows, half = packed.shape
    pairs = packed.view(rows, half // (2 * INT4_LANE), INT4_LANE, 2).to(torch.int32)
    words = pairs[..., 0] | pairs[..., 1] << 8  # (N, blocks, 32)
    nibbles = torch.stack([(words >> (4 * i)) & NIBBLE for i in range(4)], dim=2)  # (N, blocks, 4, 32)
    return nibbles.to(torch.uint8).reshape(rows, 2 * half)


def _per_value(table: torch.Tensor, k: int) -> torch.Tensor:
    """(N, G) per-group values -> (N, K), each repeated over its group."""
    return table.repeat_interleave(k // table.shape[1], dim=1)


def dequantize(packed: PackedWeights, dtype: torch.dtype) -> torch.Tensor:
    """The weight (N, K) the packed one stands for: computed in float32, rounded once to `dtype`."""
    if packed.bits == 16:
        return packed.weight.to(dtype)
    k = packed.in_features
    scales = _per_value(packed.scales.float(), k)
    if packed.bits == 8:
        return (packed.weight.float() * scales).to(dtype)
    zeros = (_per_value(packed.zeros.float(), k) if packed.zeros is not None
             else torch.full((), float(INT4_SYMMETRIC_ZERO), device=packed.weight.device))
    return ((unpack_int4(packed.weight).float() - zeros) * scales).to(dtype)


def reference_linear(x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
    """x @ dequantized.T in x's dtype: the always-correct path (any device, any dtype)."""
    return F.linear(x, dequantize(packed, x.dtype))


class CpuQuantizedLinear:
    """The compiled int8/int4 matmuls where they apply (bf16 x on a CPU with AVX512-BF16), the reference
    elsewhere. `module` is the compiled extension; `kernel_rows` and `large_matmul` come from the kernel
    plan (kernels/planning.py): up to that many rows of x stream the packed weight, more dequantize it to
    bf16, a slice of rows at a time, each slice multiplied right away by the GEMM the bf16 weights would
    run."""

    def __init__(self, module, bf16_dot_products: bool, plan) -> None:
        self._module = module
        self._bf16_dot_products = bf16_dot_products
        self._plan = plan  # a callable returning the current KernelPlan (it is timed after load)

    def supports(self, packed: PackedWeights) -> bool:
        """Whether the compiled kernels take this weight (and this CPU runs them)."""
        if packed.bits == 16:
            return packed.weight.dtype == torch.bfloat16
        if not self._bf16_dot_products or packed.weight.device.type != "cpu":
            return False
        groups = packed.scales.shape[1]
        group = packed.in_features // groups
        if packed.bits == 8:
            return (packed.weight.dtype == torch.int8 and packed.scales.dtype == torch.float32
                    and group % INT8_KERNEL_GROUP == 0)
        return (packed.weight.dtype == torch.uint8 and packed.scales.dtype == torch.float16
                and (group in INT4_GROUPS or group % INT4_BLOCK == 0))

    def kernel_arguments(self, packed: PackedWeights) -> tuple[torch.Tensor, ...]:
        """(weight, scales[, zeros]) as the extension's functions take them (empty zeros: symmetric)."""
        if packed.bits == 8:
            return packed.weight, packed.scales
        zeros = packed.zeros if packed.zeros is not None else torch.empty(0, dtype=torch.uint8)
        return packed.weight, packed.scales, zeros

    def linear(self, x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
        """x (..., K) @ dequantized(packed).T -> (..., N)."""
        if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and packed.bits in (8, 4)
                and self.supports(packed)):
            return reference_linear(x, packed)
        k, n = packed.in_features, packed.out_features
        rows = x.numel() // k
        flat = x.reshape(rows, k)
        plan = self._plan()
        if rows > plan.max_kernel_rows:
            gemm = self._module.gemm_int8 if packed.bits == 8 else self._module.gemm_int4
            slice_rows = max(1, GEMM_SLICE_BYTES // (k * torch.bfloat16.itemsize))
            out = gemm(flat, *self.kernel_arguments(packed), slice_rows, plan.large_matmul is linear_via_fp32)
        else:
            kernel = self._module.linear_int8 if packed.bits == 8 else self._module.linear_int4
            out = kernel(flat, *self.kernel_arguments(packed))
        return out.view(*x.shape[:-1], n)

    def dequantize(self, packed: PackedWeights) -> torch.Tensor:
        """bf16 (N, K), through the compiled kernels: the same values as `dequantize(packed, bfloat16)`."""
        kernel = self._module.dequantize_int8 if packed.bits == 8 else self._module.dequantize_int4
        return kernel(*self.kernel_arguments(packed))
