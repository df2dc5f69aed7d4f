"""Which quantization a model runs with, checked before anything loads: `--quantization` (a bf16 checkpoint
quantized while it loads) or a pre-quantized checkpoint's `quantization_config` in config.json.

Supported checkpoint formats, as their reference loaders read them (vLLM's fp8.py, awq.py, gptq.py;
AutoAWQ; transformers' integrations):
- fine-grained FP8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`, dynamic
  activations), as in Qwen3-*-FP8: `weight` float8_e4m3fn (N, K), `weight_scale_inv` float32, one per
  block of the weight, multiplied in to dequantize;
- AWQ (`quant_method: awq`, 4 bits, `version: gemm`, `zero_point: true`), as in Qwen3-*-AWQ;
- GPTQ (`quant_method: gptq`, 4 or 8 bits, `desc_act: false`), `checkpoint_format` gptq (zero points
  stored less one) or gptq_v2;
- llm-compressor's compressed-tensors (`quant_method: compressed-tensors`): W4A16, W8A16, W8A8 (int8) and
  FP8-dynamic schemes, as compressed_tensors.py says.
Anything else is refused with what is supported, never loaded approximately.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mili_openai.model.quantization.compressed_tensors import SUPPORTED_TEXT as COMPRESSED_TENSORS_TEXT
from mili_openai.model.quantization.compressed_tensors import (
    CompressedTensorsScheme,
    parse_compressed_tensors,
    positive_int,
)

DYNAMIC_METHODS = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
COMPRESSED_TENSORS = "compressed-tensors"
CHECKPOINT_METHODS = ("fp8", "awq", "gptq", COMPRESSED_TENSORS)
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its stored zero points lack
SUPPORTED_TEXT = ("fp8 (fine-grained e4m3 blocks, dynamic activations), awq (4-bit, GEMM packing, zero points), "
                  f"gptq (4 or 8 bits, desc_act false), {COMPRESSED_TENSORS_TEXT}")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """What a checkpoint's `quantization_config` says its projections hold."""

    method: str  # "fp8", "awq", "gptq" or "compressed-tensors"
    bits: int
    group_size: int | None = None  # values along K per scale; None: one per output row (GPTQ's -1)
    block: tuple[int, int] | None = None  # fp8: (rows, columns) of the weight per scale
    zero_offset: int = 0  # GPTQ v1 stores each zero point less one
    scheme: CompressedTensorsScheme | None = None  # compressed-tensors: its scheme and which modules it covers

    def describe(self) -> str:
        if self.scheme is not None:
            return self.scheme.describe()
        if self.method == "fp8":
            return f"fp8 (e4m3, {self.block[0]}x{self.block[1]} blocks)"
        groups = f"groups of {self.group_size}" if self.group_size else "one scale per row"
        return f"{self.method} ({self.bits}-bit, {groups})"


def read_checkpoint_quantization(path: str | Path) -> CheckpointQuantization | None:
    """The quantization config.json declares (None: unquantized); ValueError for one this server refuses."""
    config = json.loads((Path(path) / "config.json").read_text())
    return parse_quantization_config(config.get("quantization_config"))


def parse_quantization_config(raw: dict[str, Any] | None) -> CheckpointQuantization | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("config.json's quantization_config must be an object")
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(raw)
    if method == "awq":
        return _awq(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == COMPRESSED_TENSORS:
        scheme = parse_compressed_tensors(raw)
        return CheckpointQuantization(method, scheme.bits, group_size=scheme.group_size, block=scheme.block,
                                      scheme=scheme)
    raise ValueError(f"quantization method {raw.get('quant_method')!r} in config.json is not supported; supported: "
                     f"{SUPPORTED_TEXT}")


def _fp8(raw: dict[str, Any]) -> CheckpointQuantization:
    if str(raw.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"fp8 checkpoints in {raw.get('fmt')!r} are not supported: only e4m3")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("fp8 checkpoints with static activation scales are not supported: only "
                         "activation_scheme 'dynamic'")
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(positive_int(b) for b in block)):
        raise ValueError("fp8 checkpoints need weight_block_size [rows, columns] (fine-grained block scales); "
                         f"per-tensor fp8 is not supported, got {block!r}")
    return CheckpointQuantization("fp8", 8, block=(int(block[0]), int(block[1])))


def _awq(raw: dict[str, Any]) -> CheckpointQuantization:
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ checkpoints of {bits} bits are not supported: only 4")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {raw.get('version')!r} is not supported: only 'gemm' packing")
    if not raw.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")
    group = raw.get("group_size", raw.get("q_group_size"))
    if not positive_int(group):
        raise ValueError(f"AWQ group_size must be a positive integer, got {group!r}")
    return CheckpointQuantization("awq", 4, group_size=int(group))


def _gptq(raw: dict[str, Any]) -> CheckpointQuantization:
    bits = raw.get("bits")
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ checkpoints of {bits} bits are not supported: only 4 or 8")
    if raw.get("desc_act"):
        raise ValueError("GPTQ checkpoints with desc_act true (act-order) are not supported: only desc_act false")
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {raw.get('checkpoint_format')!r} is not supported; supported: "
                         f"{tuple(GPTQ_FORMATS)}")
    group = raw.get("group_size", -1)
    if group != -1 and not positive_int(group):
        raise ValueError(f"GPTQ group_size must be -1 or a positive integer, got {group!r}")
    return CheckpointQuantization("gptq", int(bits), group_size=None if group == -1 else int(group),
                                  zero_offset=GPTQ_FORMATS[checkpoint_format])


def check_quantization(requested: str | None, checkpoint: CheckpointQuantization | None, device_type: str) -> None:
    """Refuse, before loading, a combination that cannot run: `--quantization` on an already quantized
    checkpoint (other than its own method), or fp8 matmuls without a CUDA GPU."""
    if requested is None:
        return
    if requested not in DYNAMIC_METHODS:
        raise ValueError(f"quantization must be one of {DYNAMIC_METHODS}, got {requested!r}")
    if checkpoint is not None and requested != checkpoint.method:
        raise ValueError(f"the checkpoint is already quantized ({checkpoint.describe()}); drop --quantization "
                         f"{requested}")
    if requested == "fp8" and checkpoint is None and device_type != "cuda":
        raise ValueError("--quantization fp8 runs fp8 matmuls (torch._scaled_mm), which need a CUDA GPU; on CPU "
                         "use --quantization int8 or int4")


