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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mili_openai.kernels.quantized import PackedWeights, pack_int4
from mili_openai.model.quantization.spec import CheckpointQuantization
from mili_openai.model.weights import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its eight
PACKED_BITS = 32
GPTQ_SYMMETRIC_ZERO_8BIT = 128


@dataclass(slots=True)
class QuantizedRows:
    """One projection's weight as levels: weight[n, k] = (levels[n, k] - zeros[n, g]) * scales[n, g]."""

    levels: torch.Tensor  # (N, K) int32
    scales: torch.Tensor  # (N, G) float16
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
    scales = torch.cat([p.scales for p in parts]).half()
    zeros = torch.cat([p.zeros for p in parts])
    if bits == 4:
        try:
            packed = pack_int4(levels)
        except ValueError as exc:
            raise CheckpointError(f"{prefix}: {exc}") from None
        return PackedWeights(4, packed, scales.contiguous(), zeros.to(torch.uint8).contiguous())
    if not bool((zeros == GPTQ_SYMMETRIC_ZERO_8BIT).all()):
        raise CheckpointError(f"{prefix}: 8-bit GPTQ with zero points other than {GPTQ_SYMMETRIC_ZERO_8BIT} "
                              "(sym false) is not supported")
    return PackedWeights(8, (levels - GPTQ_SYMMETRIC_ZERO_8BIT).to(torch.int8).contiguous(),
                         scales.float().contiguous())


def read_fp8(tensors: dict[str, torch.Tensor], prefix: str,
             quant: CheckpointQuantization) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight (N, K), its block scales)."""
    weight, scale_inv = _take(tensors, prefix, ("weight", "weight_scale_inv"))
    rows, columns = quant.block
    expected = (-(-weight.shape[0] // rows), -(-weight.shape[1] // columns))
    if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{prefix}: an fp8 weight needs float8_e4m3fn values and {expected} block scales, got "
                              f"{weight.dtype} and {tuple(scale_inv.shape)}")
    return weight, scale_inv.float()
