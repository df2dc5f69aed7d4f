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
- W8A8 (`int8_inputs`, 8-bit weights only): x is quantized to int8 before the weights multiply it, per token
  (s_m = max|x_m| / 127, q_m = round(x_m * (127 / max|x_m|)), vLLM's form, a reciprocal multiplied in; a row
  of zeros gives zeros) or with a static scale s (q_m = round(x_m / s)); half to even, clamped to int8's
  [-128, 127]. y = s_m * (q_m . W): the integer products add up exactly and s_m * s_w scales the sum, as vLLM's
  scaled int8 GEMM does. Weight-only kernels run it on the integers q in x's dtype (exact in bf16 and float32,
  |q| <= 128) and scale the rows of their output (`int8_input_linear`); the CPU one multiplies int8 by int8.

The dequantized weight in a dtype is the float32 product rounded once to it: what the CPU kernels
dequantize to in bf16 (the prefill GEMM's weights), and the weights the transformers oracle is given in tests.
Their decode matmuls for int8 with one scale a row and int4 with groups of whole blocks multiply the
float32 products themselves (a scale applied to a sum), not their bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mili_openai.kernels.planning import linear_via_fp32

INT8_KERNEL_GROUP = 32  # the int8 kernel takes rows (or groups) of a multiple of this many values
W8A8_KERNEL_GROUP = 64  # the W8A8 kernel takes groups of a multiple of this many values (rows: INT8_KERNEL_GROUP)
W8A8_KERNEL_MAX_K = 65536  # its int32 sums of (q + 128) * w stay exact up to this K
INT8_MIN, INT8_MAX = -128, 127
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


class Int8Inputs(NamedTuple):
    """W8A8: how x is quantized to int8 before the int8 weights multiply it."""

    static_scale: torch.Tensor | None = None  # float32 (1,), the checkpoint's; None: per token, dynamic


class PackedWeights(NamedTuple):
    """A projection's weight in the layout above; `bits` 16 is a dense weight in the model's dtype."""

    bits: int  # 16, 8 or 4
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    int8_inputs: Int8Inputs | None = None  # W8A8 (8-bit weights); None: x multiplies the weights as it is

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
    """x @ dequantized.T in x's dtype (W8A8: x quantized first): the always-correct path (any device, any dtype)."""
    if packed.int8_inputs is not None:
        return int8_input_linear(x, packed, reference_linear)
    return F.linear(x, dequantize(packed, x.dtype))


def quantize_int8_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (q (..., K) in x's dtype holding integers in [-128, 127], float32 scales (..., 1) or the
    static scale (1,)): x ~ q * scale, row by row (W8A8 above)."""
    values = x.float()
    if static_scale is None:
        amax = values.abs().amax(dim=-1, keepdim=True)  # (..., 1)
        scale = amax / INT8_MAX
        inverse = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
        levels = torch.round(values * inverse)
    else:
        scale = static_scale
        levels = torch.round(values / scale)
    return levels.clamp_(INT8_MIN, INT8_MAX).to(x.dtype), scale


def int8_input_linear(x: torch.Tensor, packed: PackedWeights,
                      matmul: Callable[[torch.Tensor, PackedWeights], torch.Tensor]) -> torch.Tensor:
    """W8A8 through a weight-only `matmul`: x quantized, its integer levels multiplied, each row of the product
    scaled by its token's scale."""
    levels, scale = quantize_int8_rows(x, packed.int8_inputs.static_scale)
    return (matmul(levels, packed._replace(int8_inputs=None)).float() * scale).to(x.dtype)


class CpuQuantizedLinear:
    """The compiled int8/int4 matmuls where they apply (bf16 x on a CPU with AVX512-BF16), the reference
    elsewhere. `module` is the compiled extension; `kernel_rows` and `large_matmul` come from the kernel
    plan (kernels/planning.py): up to that many rows of x stream the packed weight, more dequantize it to
    bf16, a slice of rows at a time, each slice multiplied right away by the GEMM the bf16 weights would
    run. W8A8 decode rows multiply int8 by int8 (AVX512-VNNI) in one call that quantizes x too; prefill
    chunks, and CPUs without VNNI, quantize x in torch and run the weight-only kernels on its levels."""

    def __init__(self, module, bf16_dot_products: bool, plan, int8_dot_products: bool) -> None:
        self._module = module
        self._bf16_dot_products = bf16_dot_products
        self._int8_dot_products = int8_dot_products
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
            int8 = (packed.weight.dtype == torch.int8 and packed.scales.dtype == torch.float32
                    and group % INT8_KERNEL_GROUP == 0)
            if packed.int8_inputs is None:
                return int8
            return (int8 and self._int8_dot_products and packed.in_features <= W8A8_KERNEL_MAX_K
                    and (groups == 1 or group % W8A8_KERNEL_GROUP == 0))
        return (packed.weight.dtype == torch.uint8 and packed.scales.dtype == torch.float16
                and (group in INT4_GROUPS or group % INT4_BLOCK == 0))

    def kernel_arguments(self, packed: PackedWeights) -> tuple[torch.Tensor, ...]:
        """(weight, scales[, zeros or the static scale]) as the extension's functions take them (empty zeros:
        symmetric; an empty static scale: per token)."""
        if packed.int8_inputs is not None:
            static = packed.int8_inputs.static_scale
            return packed.weight, packed.scales, torch.empty(0) if static is None else static
        if packed.bits == 8:
            return packed.weight, packed.scales
        zeros = packed.zeros if packed.zeros is not None else torch.empty(0, dtype=torch.uint8)
        return packed.weight, packed.scales, zeros

    def linear(self, x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
        """x (..., K) @ dequantized(packed).T -> (..., N) (W8A8: x quantized first)."""
        compiled = (x.dtype == torch.bfloat16 and x.device.type == "cpu" and packed.bits in (8, 4)
                    and self.supports(packed))
        k, n = packed.in_features, packed.out_features
        rows = x.numel() // k
        plan = self._plan()
        if packed.int8_inputs is not None and not (compiled and rows <= plan.max_kernel_rows):
            return int8_input_linear(x, packed, self.linear)
        if not compiled:
            return reference_linear(x, packed)
        flat = x.reshape(rows, k)
        if packed.int8_inputs is not None:
            out = self._module.linear_w8a8(flat, *self.kernel_arguments(packed))
        elif rows > plan.max_kernel_rows:
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
