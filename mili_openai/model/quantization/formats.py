"""Pre-quantized checkpoints' tensors, read into this server's packed weights.

Layouts, per projection of in_features K and out_features N (transformers' (N, K) weight), as AutoAWQ,
AutoGPTQ/GPTQModel and DeepSeek-style FP8 write them:
- AWQ (GEMM): `qweight` int32 (K, N / 8), each int32 holding 8 output columns' 4-bit levels, column
  AWQ_ORDER[i] in bits 4i..4i+3; `qzeros` int32 (K / g, N / 8), packed the same way; `scales` float16
  (K / g, N). weight[n, k] = (level - zero) * scale of k's group.
- GPTQ: `qweight` int32 (K * bits / 32, N), each int32 holding 32 / bits consecutive input rows, row i in
  bits i*bits upward; `qzeros` int32 (G, N * bits / 32) holding consecutive output columns the same way,
  each stored less one in checkpoint_format gptq (v1); `scales` float16 (G, N); `g_idx` int32 (K,), each
  input row's group, which desc_act false makes k // g.
- FP8: `weight` float8_e4m3fn (N, K); `weight_scale_inv` float32 (ceil(N / rows), ceil(K / columns)),
  multiplied in: weight = e4m3 * scale of its block.
- compressed-tensors (compressed_tensors.py has the schemes), as its compressors write them: int weights
  are signed values q in [-2^(bits-1), 2^(bits-1)) stored offset by 2^(bits-1); `pack-quantized` packs
  them along K into `weight_packed` int32 (N, K * bits / 32), value i of each int32 in bits i*bits
  upward, with `weight_shape` (N, K); `int-quantized`/`naive-quantized` keep them in `weight` int8 (N, K).
  `weight_scale` (N, G) in the model's dtype, G = 1 for channel. Zero points (asymmetric) are signed the
  same way: `weight_zero_point` int32 (N * bits / 32, G) packed along N when packed, else int8 (N, G).
  weight[n, k] = (q - zero) * scale. `float-quantized`: `weight` float8_e4m3fn (N, K), `weight_scale`
  (N, 1) per row, one value per tensor, or (ceil(N / rows), ceil(K / columns)) per block. Static int8
  activations (W8A8) add `input_scale` (1,) in the model's dtype; older writers also stored an all-zero
  `input_zero_point` for symmetric ones, which the compressors now drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mili_openai.kernels.fp8 import Fp8Weights
from mili_openai.kernels.quantized import PackedWeights, pack_int4
from mili_openai.model.quantization.compressed_tensors import PACKED, CompressedTensorsScheme
from mili_openai.model.quantization.spec import CheckpointQuantization
from mili_openai.model.weights import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its eight
PACKED_BITS = 32
SYMMETRIC_ZERO_8BIT = 128  # 8-bit levels are q + 128


@dataclass(slots=True)
class QuantizedRows:
    """One projection's weight as levels: weight[n, k] = (levels[n, k] - zeros[n, g]) * scales[n, g]."""

    levels: torch.Tensor  # (N, K) int32
    scales: torch.Tensor  # (N, G) as stored (float16; compressed-tensors: the model's dtype)
    zeros: torch.Tensor  # (N, G) int32


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 (..., C) -> (..., C, 32 / bits): field i of each int32, bits i*bits upward."""
    shifts = torch.arange(0, PACKED_BITS, bits, dtype=torch.int32)
    return (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


def _take(tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...]) -> list[torch.Tensor]:
    absent = [f"{prefix}.{name}" for name in names if f"{prefix}.{name}" not in tensors]
    if absent:
        raise CheckpointError(f"quantized checkpoint lacks {', '.join(absent)}")
    return [tensors.pop(f"{prefix}.{name}") for name in names]


def read_awq(tensors: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuantization) -> QuantizedRows:
    qweight, qzeros, scales = _take(tensors, prefix, ("qweight", "qzeros", "scales"))

    def columns(packed: torch.Tensor) -> torch.Tensor:  # (R, C / 8) -> (R, C) in column order
        fields = _fields(packed, 4)
        ordered = torch.empty_like(fields)
        ordered[..., list(AWQ_ORDER)] = fields
        return ordered.flatten(-2)

    levels = columns(qweight)  # (K, N)
    _check_groups(prefix, levels.shape[0], scales.shape[0], quant.group_size)
    return QuantizedRows(levels.t().contiguous(), scales.t().contiguous(), columns(qzeros).t().contiguous())


def read_gptq(tensors: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuantization) -> QuantizedRows:
    qweight, qzeros, scales = _take(tensors, prefix, ("qweight", "qzeros", "scales"))
    g_idx = tensors.pop(f"{prefix}.g_idx", None)
    bits = quant.bits
    levels = _fields(qweight, bits).permute(0, 2, 1).flatten(0, 1)  # (K, N): rows in order
    zeros = _fields(qzeros, bits).flatten(-2) + quant.zero_offset  # (G, N)
    k = levels.shape[0]
    _check_groups(prefix, k, scales.shape[0], quant.group_size)
    if g_idx is not None:
        expected = torch.arange(k) // (quant.group_size or k)
        if not torch.equal(g_idx.to(torch.int64), expected):
            raise CheckpointError(f"{prefix}.g_idx is not in order (an act-order checkpoint?): only desc_act false "
                                  "GPTQ checkpoints are supported")
    return QuantizedRows(levels.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous())


def _check_groups(prefix: str, k: int, groups: int, group_size: int | None) -> None:
    expected = 1 if group_size is None else -(-k // group_size)
    if groups != expected or (group_size is not None and k % group_size):
        raise CheckpointError(f"{prefix}: {groups} scale rows for {k} inputs do not fit group_size {group_size}")


def pack_rows(parts: list[QuantizedRows], bits: int, prefix: str) -> PackedWeights:
    """Projections fused along N (q, k, v or gate, up) -> one packed weight."""
    levels = torch.cat([p.levels for p in parts])
    scales = torch.cat([p.scales for p in parts])
    zeros = torch.cat([p.zeros for p in parts])
    if bits == 4:
        try:
            packed = pack_int4(levels)
        except ValueError as exc:
            raise CheckpointError(f"{prefix}: {exc}") from None
        return PackedWeights(4, packed, scales.half().contiguous(), zeros.to(torch.uint8).contiguous())
    if not bool((zeros == SYMMETRIC_ZERO_8BIT).all()):
        raise CheckpointError(f"{prefix}: 8-bit weights with zero points other than {SYMMETRIC_ZERO_8BIT} "
                              "(asymmetric) are not supported")
    return PackedWeights(8, (levels - SYMMETRIC_ZERO_8BIT).to(torch.int8).contiguous(), scales.float().contiguous())


def float16_rounded(parts: list[QuantizedRows]) -> int:
    """How many of the parts' scales float16 (the int4 layout's scale type) does not hold exactly: bf16 ones
    below 2^-17 or float32 ones with more than 11 significant bits."""
    return sum(int((p.scales.half().to(p.scales.dtype) != p.scales).sum()) for p in parts)


def read_fp8(tensors: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuantization) -> Fp8Weights:
    """The e4m3 weight (N, K) with its block scales."""
    weight, scale_inv = _take(tensors, prefix, ("weight", "weight_scale_inv"))
    rows, columns = quant.block
    expected = (-(-weight.shape[0] // rows), -(-weight.shape[1] // columns))
    if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{prefix}: an fp8 weight needs float8_e4m3fn values and {expected} block scales, got "
                              f"{weight.dtype} and {tuple(scale_inv.shape)}")
    return Fp8Weights(weight, scale_inv.float(), quant.block)


def read_compressed_int(tensors: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuantization) -> QuantizedRows:
    """A compressed-tensors int projection (pack-, int- or naive-quantized) as levels q + 2^(bits-1)."""
    scheme: CompressedTensorsScheme = quant.scheme
    bits, offset = scheme.bits, 1 << (scheme.bits - 1)
    if scheme.format == PACKED:
        packed, shape, scales = _take(tensors, prefix, ("weight_packed", "weight_shape", "weight_scale"))
        n, k = _weight_shape(prefix, shape)
        if (packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n
                or packed.shape[1] * PACKED_BITS < k * bits):
            raise CheckpointError(f"{prefix}.weight_packed: {packed.dtype} {tuple(packed.shape)} does not hold a "
                                  f"({n}, {k}) weight of {bits}-bit values packed in int32")
        levels = _fields(packed, bits).flatten(-2)[:, :k]  # (N, K): value i of each int32 is column 32/bits*j + i
    else:
        weight, scales = _take(tensors, prefix, ("weight", "weight_scale"))
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise CheckpointError(f"{prefix}.weight: {scheme.format} weights are int8 (N, K), got {weight.dtype}")
        (n, k), levels = weight.shape, weight.to(torch.int32) + offset
    if scales.dim() != 2 or scales.shape[0] != n or not scales.is_floating_point():
        raise CheckpointError(f"{prefix}.weight_scale: expected float ({n}, groups), got {scales.dtype} "
                              f"{tuple(scales.shape)}")
    _check_groups(prefix, k, scales.shape[1], scheme.group_size)
    if scheme.symmetric:
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    else:
        (stored,) = _take(tensors, prefix, ("weight_zero_point",))
        if scheme.format == PACKED:  # int32 (N * bits / 32, G): consecutive rows of a column in one int32
            zeros = _fields(stored, bits).permute(0, 2, 1).flatten(0, 1)[:n]
        else:
            zeros = stored.to(torch.int32) + offset
        if tuple(zeros.shape) != tuple(scales.shape):
            raise CheckpointError(f"{prefix}.weight_zero_point: {tuple(stored.shape)} does not fit "
                                  f"{tuple(scales.shape)} scales")
    g_idx = tensors.pop(f"{prefix}.weight_g_idx", None)
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // (scheme.group_size or k)):
        raise CheckpointError(f"{prefix}.weight_g_idx is not in order (act-order): only checkpoints whose groups "
                              "are consecutive columns are supported")
    return QuantizedRows(levels, scales, zeros.contiguous())


def _weight_shape(prefix: str, shape: torch.Tensor) -> tuple[int, int]:
    values = shape.reshape(-1).tolist()
    if len(values) != 2 or min(values) < 1:
        raise CheckpointError(f"{prefix}.weight_shape must be (out_features, in_features), got {values}")
    return int(values[0]), int(values[1])


def read_compressed_fp8(tensors: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuantization) -> Fp8Weights:
    """A compressed-tensors fp8 projection: a scale per row (channel; tensor's one value repeated) or block."""
    scheme: CompressedTensorsScheme = quant.scheme
    weight, scales = _take(tensors, prefix, ("weight", "weight_scale"))
    n, k = weight.shape
    rows, columns = scheme.block if scheme.strategy == "block" else (1, k)
    expected = (-(-n // rows), -(-k // columns))
    if scheme.strategy == "tensor" and scales.numel() == 1:
        scales = scales.reshape(1, 1).expand(n, 1)
    if weight.dtype != torch.float8_e4m3fn or scales.numel() != expected[0] * expected[1]:
        raise CheckpointError(f"{prefix}: a {scheme.strategy} fp8 weight needs float8_e4m3fn values and {expected} "
                              f"scales, got {weight.dtype} and {tuple(scales.shape)}")
    return Fp8Weights(weight, scales.float().reshape(expected).contiguous(), (rows, columns))


def read_input_scale(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A compressed-tensors projection's static int8 activation scale (W8A8 per tensor), as float32 (1,)."""
    (scale,) = _take(tensors, prefix, ("input_scale",))
    zero_point = tensors.pop(f"{prefix}.input_zero_point", None)
    if zero_point is not None and bool(zero_point.any()):
        raise CheckpointError(f"{prefix}.input_zero_point: asymmetric int8 activations (nonzero zero points) are "
                              "not supported")
    if scale.numel() != 1 or not scale.is_floating_point() or not bool(torch.isfinite(scale).all()) or scale <= 0:
        raise CheckpointError(f"{prefix}.input_scale: a static per-tensor scale is one positive float, got "
                              f"{scale.dtype} {tuple(scale.shape)}")
    return scale.float().reshape(1)
