"""The map between a transformers Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3-Next state dict and ours: q/k/v and
gate/up (and Gated DeltaNet's four input projections) concatenated into the fused projections, each sparse
layer's experts stacked into two (E, ...) tensors, everything else by the same name (the hybrids' own
renames come first: model/hybrid_weights.py). Missing or unexpected weights are an error that names them in the checkpoint's
own spelling."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mili_openai.model.config import ModelConfig

LAYER_PREFIX = "model.layers"
LM_HEAD = "lm_head.weight"
MAX_NAMES_SHOWN = 8  # keep an error about a mismatched checkpoint readable
# fused module (relative to a layer) -> its checkpoint parts, in row order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    # Qwen3.5 / Qwen3-Next (model/qwen3_5.py); absent from Qwen3's modules, so skipped there
    "linear_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                            "linear_attn.in_proj_a"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}
DENSE_MLP = "mlp.gate_up_proj"
# stacked experts (relative to a layer) -> the parts of expert e, in row order, each under `EXPERT_PREFIX.e.`;
# a checkpoint may also hold them stacked already (transformers 5's in-memory layout), under the same name
STACKED_EXPERTS: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.experts.down_proj": ("down_proj",),
}
EXPERT_PREFIX = "mlp.experts"


class CheckpointError(ValueError):
    """The checkpoint's weights do not fit the architecture its config.json describes."""


def _names(names: Iterable[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:MAX_NAMES_SHOWN])
    return shown + (f", ... ({len(ordered)} in all)" if len(ordered) > MAX_NAMES_SHOWN else "")


def checkpoint_to_model_state(
    tensors: dict[str, torch.Tensor], config: ModelConfig, expected: Iterable[str],
    missing: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Turn checkpoint tensors (consumed: the dict is emptied) into our state dict.

    `expected` is the set of our model's state-dict keys; `missing`, checkpoint names an earlier step found
    absent. Raises CheckpointError listing every missing or unexpected checkpoint name.
    """
    expected = set(expected)
    missing = list(missing or ())
    if config.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)  # transformers ties it to the embedding and ignores a stored copy too
    state: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        fuse_layer_tensors(tensors, f"{LAYER_PREFIX}.{layer}", config, config.is_sparse_layer(layer), expected,
                           state, missing)
    return take_named_tensors(tensors, expected, state, missing)


def fuse_layer_tensors(tensors: dict[str, torch.Tensor], prefix: str, config: ModelConfig, sparse: bool,
                       expected: set[str], state: dict[str, torch.Tensor], missing: list[str]) -> None:
    """One decoder layer's (under `prefix`) fused projections and stacked experts into `state`, their parts
    popped from `tensors`; absent parts' names into `missing`."""
    if sparse:
        _stack_experts(tensors, prefix, config.moe.num_experts, state, missing)
    for fused, parts in FUSED_PARTS.items():
        if (sparse and fused == DENSE_MLP) or f"{prefix}.{fused}.weight" not in expected:  # experts, or a
            # quantized module that already holds it
            continue
        names = [f"{prefix}.{part}.weight" for part in parts]
        absent = [name for name in names if name not in tensors]
        if absent:
            missing.extend(absent)
            continue
        state[f"{prefix}.{fused}.weight"] = torch.cat([tensors.pop(name) for name in names], dim=0)


def take_named_tensors(tensors: dict[str, torch.Tensor], expected: set[str], state: dict[str, torch.Tensor],
                   missing: list[str]) -> dict[str, torch.Tensor]:
    """The unfused tensors by name; CheckpointError naming every missing or unexpected one."""
    for name in list(tensors):
        if name in expected:
            state[name] = tensors.pop(name)
    missing.extend(name for name in expected - state.keys() if not _is_fused(name))
    if missing or tensors:
        problems = []
        if missing:
            problems.append(f"missing weights: {_names(missing)}")
        if tensors:
            problems.append(f"unexpected weights: {_names(tensors)}")
        raise CheckpointError(f"checkpoint does not match its config ({'; '.join(problems)})")
    return state


def _stack_experts(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int, state: dict[str, torch.Tensor],
                   missing: list[str]) -> None:
    """Expert e's [gate; up] rows -> gate_up_proj[e] (E, 2I, H), its down -> down_proj[e] (E, H, I)."""
    for stacked, parts in STACKED_EXPERTS.items():
        if f"{prefix}.{stacked}" in tensors:  # stored stacked: taken by name
            continue
        names = [[f"{prefix}.{EXPERT_PREFIX}.{expert}.{part}.weight" for part in parts]
                 for expert in range(num_experts)]
        absent = [name for group in names for name in group if name not in tensors]
        if absent:
            missing.extend(absent)
            continue
        state[f"{prefix}.{stacked}"] = torch.stack([torch.cat([tensors.pop(name) for name in group])
                                                    for group in names])


def _is_fused(name: str) -> bool:
    return any(f".{fused}." in name for fused in FUSED_PARTS) or name.endswith(tuple(STACKED_EXPERTS))

