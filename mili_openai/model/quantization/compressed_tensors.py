"""llm-compressor's checkpoints (`quant_method: compressed-tensors`, e.g. RedHatAI/Qwen3-*-quantized.w4a16,
*-quantized.w8a16, *-FP8-dynamic): which scheme their `quantization_config` declares, checked before
anything loads; formats.py reads the tensors.

The config holds `config_groups`, each a scheme (`targets`, `weights`, `input_activations`, optionally its own
`format`) over the modules its targets name (`Linear`, an exact module name, or `re:` a regex matched from
the name's start), less those `ignore` names the same way; the top-level `format` says how weights are stored.
Supported, mapped onto this server's int8/int4 and fp8 layouts:
- int weights, 4 or 8 bits, strategy `group` or `channel`, no activation quantization (W4A16, W8A16), stored
  `pack-quantized` (32 / bits values per int32) or `int-quantized`/`naive-quantized` (int8 values);
  symmetric, or asymmetric with zero points at 4 bits; `actorder` none, or `weight` (it only orders
  calibration: the stored groups are the same);
- the same 8-bit symmetric int weights with int8 activations (W8A8), symmetric, either dynamic per token
  (`strategy: token`, `dynamic: true`) or static per tensor (`strategy: tensor`, `dynamic: false`, an
  `input_scale` stored per module; activations.py has the numbers);
- fp8 e4m3 weights (`float-quantized`), symmetric, strategy `channel`, `tensor` or `block`, with dynamic
  fp8 activations (FP8-dynamic, FP8-block).
One scheme for every quantized module. Anything else is refused with what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PACKED = "pack-quantized"
INT_FORMATS = (PACKED, "int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_BITS = (4, 8)
INT_STRATEGIES = ("group", "channel")
FLOAT_STRATEGIES = ("channel", "tensor", "block")
ACTIVATION_STRATEGIES = ("token", "group")  # dynamic fp8 activations: per token, or per group (FP8-block)
DYNAMIC_TOKEN, STATIC_TENSOR = "token", "tensor"  # the int8 activation schemes (W8A8): how each scale is found
INT8_ACTIVATIONS = {DYNAMIC_TOKEN: True, STATIC_TENSOR: False}  # strategy -> the `dynamic` it needs
CALIBRATION_ONLY_ACTORDER = ("weight", "static")  # `static` is compressed-tensors' alias of `weight`
LINEAR_CLASS = "Linear"  # every projection and the LM head are Linear modules
REGEX_PREFIX = "re:"
SUPPORTED_TEXT = ("compressed-tensors: int weights of 4 or 8 bits (pack-quantized, int-quantized or naive-quantized; "
                  "group or channel scales; zero points at 4 bits) without activation quantization, or 8-bit "
                  "symmetric int weights with symmetric int8 activations (W8A8: dynamic per token, or static per "
                  "tensor), or fp8 e4m3 weights (float-quantized; channel, tensor or block scales) with dynamic fp8 "
                  "activations")


@dataclass(frozen=True, slots=True)
class CompressedTensorsScheme:
    """The one weight scheme a compressed-tensors checkpoint's quantized modules share, and which they are."""

    format: str  # pack-quantized, int-quantized, naive-quantized or float-quantized
    type: str  # "int" or "float" (e4m3)
    bits: int
    strategy: str  # group or channel (int); channel, tensor or block (float)
    group_size: int | None = None  # strategy group: values along K per scale
    symmetric: bool = True  # else zero points are stored (int, 4 bits)
    block: tuple[int, int] | None = None  # strategy block: (rows, columns) of the weight per scale
    activations: str | None = None  # int8 activations (W8A8): DYNAMIC_TOKEN or STATIC_TENSOR; None: weight-only
    targets: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()

    @property
    def marker(self) -> str:
        """The tensor a quantized module has and a dense one lacks."""
        return "weight_packed" if self.format == PACKED else "weight_scale"

    def quantizes(self, name: str) -> bool:
        """Whether the module of checkpoint name `name` (a projection or the LM head) is quantized."""
        return _matches(name, self.targets) and not _matches(name, self.ignore)

    def describe(self) -> str:
        if self.type == "float":
            scales = {"channel": "a scale per row", "tensor": "a scale per tensor"}.get(self.strategy)
            scales = scales or f"{self.block[0]}x{self.block[1]} blocks"
            return f"compressed-tensors (fp8 e4m3, {scales}, dynamic activations)"
        groups = f"groups of {self.group_size}" if self.strategy == "group" else "one scale per row"
        zeros = "symmetric" if self.symmetric else "zero points"
        activations = {DYNAMIC_TOKEN: "; int8 activations per token, dynamic",
                       STATIC_TENSOR: "; int8 activations per tensor, static"}.get(self.activations, "")
        return f"compressed-tensors ({self.bits}-bit, {groups}, {zeros}; {self.format}{activations})"


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(pattern == LINEAR_CLASS or pattern == name
               or (pattern.startswith(REGEX_PREFIX) and re.match(pattern[len(REGEX_PREFIX):], name) is not None)
               for pattern in patterns)


def parse_compressed_tensors(raw: dict[str, Any]) -> CompressedTensorsScheme:
    """config.json's `quantization_config` -> its scheme; ValueError naming what is refused."""
    if raw.get("kv_cache_scheme") is not None:
        raise ValueError("compressed-tensors checkpoints with a kv_cache_scheme (quantized K/V) are not supported: "
                         "only kv_cache_scheme null")
    if raw.get("sparsity_config"):
        raise ValueError("compressed-tensors checkpoints with a sparsity_config (e.g. 2:4 sparsity) are not supported")
    if raw.get("transform_config"):
        raise ValueError("compressed-tensors checkpoints with a transform_config (rotations) are not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("a compressed-tensors quantization_config needs config_groups")
    ignore = _names(raw.get("ignore") or [], "ignore")
    schemes = {name: _group(name, group, raw.get("format")) for name, group in groups.items()}
    shape = next(iter(schemes.values()))[0]
    for name, (other, _) in schemes.items():
        if other != shape:
            raise ValueError(f"compressed-tensors config group {name!r} quantizes differently from the others; mixed "
                             f"schemes are not supported: one scheme for every quantized module ({SUPPORTED_TEXT})")
    targets = tuple(target for _, group_targets in schemes.values() for target in group_targets)
    return CompressedTensorsScheme(**shape, targets=targets, ignore=ignore)


def _names(value: Any, field: str) -> tuple[str, ...]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"compressed-tensors {field} must be a list of module names, got {value!r}")
    for name in value:
        if name[:1].isupper() and name != LINEAR_CLASS:
            raise ValueError(f"compressed-tensors {field} entry {name!r}: module classes other than {LINEAR_CLASS} "
                             "are not supported; name modules, or match them with 're:' regexes")
        if name.startswith(REGEX_PREFIX):
            try:
                re.compile(name[len(REGEX_PREFIX):])
            except re.error as exc:
                raise ValueError(f"compressed-tensors {field} entry {name!r} is not a valid regex: {exc}") from None
    return tuple(value)


def _group(name: str, group: Any, top_format: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """One config group -> (its scheme's fields, its targets)."""
    if not isinstance(group, dict):
        raise ValueError(f"compressed-tensors config group {name!r} must be a scheme object (preset names such as "
                         f"W4A16 mapped to targets are not supported), got {group!r}")
    targets = _names(group.get("targets") or [], "targets")
    if not targets:
        raise ValueError(f"compressed-tensors config group {name!r} has no targets")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"compressed-tensors config group {name!r} quantizes no weights; only weight quantization "
                         f"is supported ({SUPPORTED_TEXT})")
    if group.get("output_activations") is not None:
        raise ValueError("compressed-tensors output_activations quantization is not supported")
    fmt = str(group.get("format") or top_format or "").lower()
    kind = str(weights.get("type", "int")).lower()
    bits = weights.get("num_bits", 8)
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors weights quantized dynamically are not supported")
    strategy = _strategy(weights)
    if kind == "int":
        shape = _int_scheme(fmt, bits, strategy, weights, group.get("input_activations"))
    elif kind == "float":
        shape = _float_scheme(fmt, bits, strategy, weights, group.get("input_activations"))
    else:
        raise ValueError(f"compressed-tensors weights of type {kind!r} are not supported; supported: {SUPPORTED_TEXT}")
    return shape, targets


def _strategy(weights: dict[str, Any]) -> str:
    """The strategy as compressed-tensors infers it when absent: group_size None -> tensor, -1 -> channel."""
    strategy = weights.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    group = weights.get("group_size")
    return "tensor" if group is None else "channel" if group == -1 else "group"


def _int_scheme(fmt: str, bits: Any, strategy: str, weights: dict[str, Any],
                activations: Any) -> dict[str, Any]:
    if fmt not in INT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} for int weights is not supported; supported: "
                         f"{INT_FORMATS} ({SUPPORTED_TEXT})")
    if bits not in INT_BITS:
        raise ValueError(f"compressed-tensors int weights of {bits} bits are not supported: only 4 or 8")
    if strategy not in INT_STRATEGIES:
        raise ValueError(f"compressed-tensors int weights with strategy {strategy!r} are not supported; supported: "
                         f"{INT_STRATEGIES}")
    actorder = weights.get("actorder")
    if actorder not in (None, False) and str(actorder).lower() not in CALIBRATION_ONLY_ACTORDER:
        raise ValueError(f"compressed-tensors actorder {actorder!r} (act-order, g_idx) is not supported: only actorder "
                         f"null or {CALIBRATION_ONLY_ACTORDER[0]!r}")
    symmetric = bool(weights.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise ValueError("compressed-tensors 8-bit int weights with zero points (symmetric false) are not supported")
    group = weights.get("group_size")
    if strategy == "group" and not positive_int(group):
        raise ValueError(f"compressed-tensors group strategy needs a positive group_size, got {group!r}")
    return dict(format=fmt, type="int", bits=bits, strategy=strategy,
                group_size=group if strategy == "group" else None, symmetric=symmetric,
                activations=None if activations is None else _int8_activations(bits, symmetric, activations))


def _int8_activations(bits: int, symmetric: bool, activations: Any) -> str:
    """A W8A8 scheme's `input_activations` -> DYNAMIC_TOKEN or STATIC_TENSOR; ValueError for any other."""
    supported = ("only symmetric int8 activations, dynamic per token (strategy token, dynamic true) or static per "
                 "tensor (strategy tensor, dynamic false), on 8-bit symmetric int weights (W8A8)")
    if not isinstance(activations, dict):
        raise ValueError(f"compressed-tensors input_activations must be an object, got {activations!r}")
    kind, act_bits = str(activations.get("type", "int")).lower(), activations.get("num_bits", 8)
    if kind != "int" or act_bits != 8:
        raise ValueError(f"compressed-tensors int weights with {act_bits}-bit {kind} activations are not supported: "
                         f"{supported}")
    if bits != 8 or not symmetric:
        raise ValueError(f"compressed-tensors {bits}-bit int weights{'' if symmetric else ' with zero points'} with "
                         f"int8 activations (W{bits}A8) are not supported: {supported}")
    if not activations.get("symmetric", True):
        raise ValueError(f"compressed-tensors asymmetric int8 activations (zero points) are not supported: "
                         f"{supported}")
    strategy, dynamic = _strategy(activations), activations.get("dynamic", False)
    if INT8_ACTIVATIONS.get(strategy) is not dynamic:
        raise ValueError(f"compressed-tensors int8 activations with strategy {strategy!r} and dynamic {dynamic!r} "
                         f"are not supported: {supported}")
    return strategy


def _float_scheme(fmt: str, bits: Any, strategy: str, weights: dict[str, Any],
                  activations: Any) -> dict[str, Any]:
    if fmt not in FLOAT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} for float weights is not supported; supported: "
                         f"{FLOAT_FORMATS} ({SUPPORTED_TEXT})")
    if bits != 8:
        raise ValueError(f"compressed-tensors float weights of {bits} bits are not supported: only 8 (fp8 e4m3)")
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors fp8 weights with zero points are not supported")
    if strategy not in FLOAT_STRATEGIES:
        raise ValueError(f"compressed-tensors fp8 weights with strategy {strategy!r} are not supported; supported: "
                         f"{FLOAT_STRATEGIES}")
    block = weights.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2 and all(map(positive_int, block))):
        raise ValueError(f"compressed-tensors block strategy needs block_structure [rows, columns], got {block!r}")
    if not isinstance(activations, dict):
        raise ValueError("compressed-tensors fp8 weights without activation quantization (FP8 W8A16) are not "
                         "supported: only dynamic fp8 activations (FP8-dynamic)")
    if not activations.get("dynamic"):
        raise ValueError("compressed-tensors checkpoints with static activation scales are not supported: only "
                         "dynamic activations")
    act_strategy = _strategy(activations)
    if (str(activations.get("type", "int")).lower() != "float" or activations.get("num_bits", 8) != 8
            or act_strategy not in ACTIVATION_STRATEGIES):
        raise ValueError(f"compressed-tensors fp8 weights with activations {activations!r} are not supported: only "
                         f"dynamic fp8 activations per token or group")
    return dict(format=fmt, type="float", bits=8, strategy=strategy,
                block=(block[0], block[1]) if strategy == "block" else None)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
