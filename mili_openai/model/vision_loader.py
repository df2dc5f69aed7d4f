"""The vision side of a vision-language checkpoint at load: the tower built from its `model.visual.*` weights
(Qwen3.5 / Qwen3.6 through model/hybrid_loader.py, Qwen3-VL through model/loader.py), and Qwen3-VL's language model
weights renamed into Qwen3's layout (`model.language_model.` -> `model.`) for the shared name map, Qwen3-VL-MoE's
stacked experts in Qwen3-MoE's."""

from __future__ import annotations

import torch

from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_weights import LANGUAGE_MODEL_PREFIX, TEXT_MODEL_PREFIX, VISION_PREFIXES
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.qwen3_5_vision import Qwen3_5VisionTower
from mili_openai.model.vision_config import VisionTowerConfig
from mili_openai.model.weights import EXPERT_PREFIX, LAYER_PREFIX, CheckpointError


def take_vision_tower(tensors: dict[str, torch.Tensor], tower: VisionTowerConfig, dtype: torch.dtype,
                      device: torch.device, source: str, backend: KernelBackend) -> Qwen3_5VisionTower:
    """The vision tower, its weights (`model.visual.*`) taken out of `tensors`, in `dtype` on `device`, on the
    language model's `backend`."""
    prefix = next((p for p in VISION_PREFIXES if any(name.startswith(p) for name in tensors)), VISION_PREFIXES[0])
    state = {name.removeprefix(prefix): tensors.pop(name).to(dtype=dtype, device=device)
             for name in [n for n in tensors if n.startswith(prefix)]}
    with torch.device("meta"):
        visual = Qwen3_5VisionTower(tower, backend)
    try:
        visual.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # missing, unexpected or misshapen: the config and the weights disagree
        raise CheckpointError(f"the vision tower's weights do not fit {source}: {exc}") from exc
    visual.to(device)  # the rotary frequencies, built on CPU, follow
    return visual.requires_grad_(False).eval()


def check_vision_language_options(config: ModelConfig, tensor_parallel: bool, quantized: bool) -> None:
    """Refuse, naming it, what Qwen3-VL does not run yet."""
    if tensor_parallel:
        raise NotImplementedError(f"{config.architecture} runs on one rank, not with --tensor-parallel-size > 1, yet")
    if quantized:
        raise NotImplementedError(f"{config.architecture} runs bf16/fp32 weights: quantization (--quantization or a "
                                  "quantized checkpoint) is not supported for it yet")


def take_qwen3_vl_tower(tensors: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype,
                        device: torch.device, source: str, backend: KernelBackend) -> Qwen3_5VisionTower:
    """Qwen3-VL's tower out of `tensors` on the language model's `backend`, and the language model's weights renamed
    to Qwen3's (in place)."""
    visual = take_vision_tower(tensors, config.vision.tower, dtype, device, source, backend)
    for name in [n for n in tensors if n.startswith(LANGUAGE_MODEL_PREFIX)]:
        tensors[TEXT_MODEL_PREFIX + name.removeprefix(LANGUAGE_MODEL_PREFIX)] = tensors.pop(name)
    if config.moe is not None:
        _experts_to_model_layout(tensors, config)
    return visual


def _experts_to_model_layout(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Qwen3-VL-MoE's stacked experts as Qwen3-MoE's modules hold them, gate_up (E, 2I, H) and down (E, H, I), in
    place. Published checkpoints store each transposed, (E, H, 2I) and (E, I, H); transformers' save_pretrained
    writes its own layout: like transformers' loader, a tensor is transposed only when its shape is not the
    module's already."""
    hidden, inner = config.hidden_size, config.moe.moe_intermediate_size
    for layer in range(config.num_hidden_layers):
        for part, rows, columns in (("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner)):
            name = f"{LAYER_PREFIX}.{layer}.{EXPERT_PREFIX}.{part}"
            stacked = tensors.get(name)
            if stacked is not None and rows != columns and tuple(stacked.shape[1:]) == (columns, rows):
                tensors[name] = stacked.transpose(1, 2).contiguous()
