"""A PEFT LoRA adapter read from its directory (`adapter_config.json` + `adapter_model.safetensors`) and checked
against the base model it is to serve on.

Each targeted projection keeps its pair as PEFT stores it, A (r, in) and B (out, r), with the adapter's scale
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` under rsLoRA) folded into B, so the delta is `x @ A.T @ B.T`.
What the serving path does not build (DoRA, `modules_to_save`, LoRA on the embedding or LM head, bias training)
is refused here, by name, before anything is served.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's names of the projections LoRA may target (which of them a base has: model/lora_targets.py)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "shared_expert_gate")
# Gated DeltaNet's: Qwen3.5's four input projections, or Qwen3-Next's two fused ones
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba",
                            "out_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS + LINEAR_ATTENTION_TARGETS
# PEFT's shorthand for "every linear layer but the head"
ALL_LINEAR = "all-linear"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (Qwen3.5's vision-language layout puts the decoder
# under model.language_model; an adapter name may sit before ".weight")
_WEIGHT_NAME = re.compile(r"^(?:base_model\.model\.)?model\.(?:language_model\.)?layers\.(\d+)\.([\w.]+?)"
                          r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")
ROUTED_EXPERTS = ".experts."  # in the module path of one MoE expert's projection
# adapter_config.json options that change the math in ways the serving path does not build, each with the
# value that means "off"
_REFUSED_OPTIONS = {
    "use_dora": False,
    "modules_to_save": None,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "use_qalora": False,
    "target_parameters": None,
    "trainable_token_indices": None,
}
# what a refused option means, where its name does not say it
_REFUSED_WHY = {"target_parameters": "LoRA on a MoE layer's routed experts, as PEFT writes it for gate_proj, up_proj "
                                     "and down_proj on Qwen3-MoE and Qwen3-Next: not served"}


class AdapterError(ValueError):
    """An adapter that cannot be served on this base: the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class TargetShape:
    """A projection's (in, out) features on the base model, as PEFT's unfused module sees them."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights on the host, float32: {(layer, PEFT module path in the layer, e.g. "self_attn.q_proj"):
    (A (r, in), B (out, r) * scale)}."""

    name: str
    path: Path
    rank: int  # the largest rank of any of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of the delta: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def load_lora_adapter(name: str, path: str | Path, shapes: dict[tuple[int, str], TargetShape],
                      max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path`. `shapes`: every projection the base serves LoRA on, by (layer,
    PEFT module path); an adapter weight for anything else, of another shape (another base), or of a rank over
    `max_rank` is an AdapterError."""
    directory = Path(path)
    config = _read_config(name, directory)
    weights_file = directory / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} not found (only safetensors adapters load)")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _WEIGHT_NAME.match(key)
        if match is None:
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA pair on a decoder layer's "
                               f"projection (supported targets: {', '.join(SUPPORTED_TARGETS)})")
        layer, module, which = int(match[1]), match[2], match[3]
        if (layer, module) not in shapes:
            why = ("LoRA on a MoE layer's routed experts is not served, only on its shared expert" if ROUTED_EXPERTS
                   in f".{module}." else "no such layer or module, or one that takes no LoRA")
            raise AdapterError(f"LoRA adapter {name!r} targets {key.rsplit('.lora_', 1)[0]!r}, which this base model "
                               f"does not serve LoRA on ({why})")
        pairs.setdefault((layer, module), {})[which] = tensor.to(torch.float32)
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    alpha, use_rslora = float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora", False))
    # each module's rank is its weights' (rank_pattern only says what they hold); alpha_pattern overrides alpha
    alpha_pattern = config.get("alpha_pattern") or {}
    weights, top_rank = {}, 0
    for (layer, module), pair in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}, layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        rank, shape = a.shape[0], shapes[(layer, module)]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise AdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
        if a.shape[1] != shape.in_features or b.shape[0] != shape.out_features:
            raise AdapterError(f"{where}: shaped for another base model (in {a.shape[1]}, out {b.shape[0]}; this "
                               f"base has in {shape.in_features}, out {shape.out_features})")
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
        module_alpha = _pattern_value(alpha_pattern, f"model.layers.{layer}.{module}", alpha)
        weights[(layer, module)] = (a.contiguous(), b * lora_scale(module_alpha, rank, use_rslora))
        top_rank = max(top_rank, rank)
    return LoraAdapter(name, directory, top_rank, weights)


def _pattern_value(patterns: dict[str, float], module_name: str, default: float) -> float:
    """PEFT's per-module override: the first pattern that matches the module's full name or a dotted suffix of it."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return float(value)
    return default


def _read_config(name: str, directory: Path) -> dict:
    """adapter_config.json, checked for what the serving path does not build."""
    config_file = directory / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} not found (a PEFT adapter directory is needed)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {config_file}: {exc}") from None
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (LORA only)")
    for option, off in _REFUSED_OPTIONS.items():
        value = config.get(option, off)
        if value not in (off, None, False, {}, []):
            why = f" ({_REFUSED_WHY[option]})" if option in _REFUSED_WHY else ""
            raise AdapterError(f"LoRA adapter {name!r}: {option}={value!r} is not supported{why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # module names, or paths ending in one
        unsupported = sorted(target for target in targets if target.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS)
        if unsupported:
            raise AdapterError(f"LoRA adapter {name!r}: target modules {unsupported} are not supported "
                               f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    elif targets is not None and targets != ALL_LINEAR and not isinstance(targets, str):
        raise AdapterError(f"LoRA adapter {name!r}: target_modules {targets!r} is neither a list nor a pattern")
    return config
