"""What a Qwen3.5 / Qwen3.6 or Qwen3-VL vision-language checkpoint says about its vision tower and its images.

`VisionTowerConfig` is config.json's `vision_config` (the ViT's shape); `VisionSpec` is what the API side needs
to turn an image into model inputs: the placeholder token ids and the checkpoint's `preprocessor_config.json`
(the image processor's resize bounds, patching and normalisation). Both are read once at load; a field mili does
not implement is refused here, by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_CONFIG_KEY = "vision_config"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
CONFIG_FILE = "config.json"
SUPPORTED_VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
SUPPORTED_VISION_ROPE = "axial"
# transformers' Qwen3_5VisionConfig defaults, for the fields a config.json may leave out
DEFAULT_VISION = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                      num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=2304, rope_theta=10000.0)
# transformers' Qwen3_5Config and Qwen3VLConfig defaults: the placeholder tokens the chat template writes (image,
# vision start, vision end), by model_type
DEFAULT_PLACEHOLDER_IDS = {"qwen3_5": (248056, 248053, 248054), "qwen3_vl": (151655, 151652, 151653)}
DEFAULT_DEEPSTACK_INDEXES = (8, 16, 24)  # transformers' Qwen3VLVisionConfig default


@dataclass(frozen=True, slots=True)
class VisionTowerConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_position_embeddings: int
    out_hidden_size: int  # the language model's hidden size: what the merger writes
    rope_theta: float
    # Qwen3-VL's DeepStack: the blocks whose output, through a merger each, is added after decoder layer 0, 1, ...
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x frames x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """The images side of a vision-language model, as the API side needs it (picklable, no torch)."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    # preprocessor_config.json as the checkpoint ships it, with the tower's patching filled in where it is silent
    preprocessor: dict[str, Any]


def read_vision_tower(config: dict[str, Any], out_hidden_size: int,
                      allow_deepstack: bool = False) -> VisionTowerConfig:
    """config.json's `vision_config` -> VisionTowerConfig; NotImplementedError naming an unsupported option.
    `allow_deepstack`: a Qwen3-VL tower (DeepStack mergers, by default at transformers' blocks); else Qwen3.5's."""
    defaults = dict(DEFAULT_VISION, deepstack_visual_indexes=DEFAULT_DEEPSTACK_INDEXES if allow_deepstack else ())
    raw = defaults | dict(config.get(VISION_CONFIG_KEY) or {})
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", SUPPORTED_VISION_ROPE) != SUPPORTED_VISION_ROPE:
        raise NotImplementedError(f"vision rope type {rope.get('rope_type')!r} is not supported (only "
                                  f"{SUPPORTED_VISION_ROPE!r})")
    if raw["hidden_act"] not in SUPPORTED_VISION_ACTIVATIONS:
        raise NotImplementedError(f"vision hidden_act {raw['hidden_act']!r} is not supported "
                                  f"({SUPPORTED_VISION_ACTIVATIONS})")
    deepstack = tuple(int(i) for i in raw.get("deepstack_visual_indexes") or ())
    if deepstack and not allow_deepstack:
        raise NotImplementedError("DeepStack vision features (Qwen3-VL's deepstack_visual_indexes) are not supported "
                                  "in a Qwen3.5 / Qwen3.6 checkpoint")
    tower = VisionTowerConfig(
        depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]), hidden_act=raw["hidden_act"],
        intermediate_size=int(raw["intermediate_size"]), num_heads=int(raw["num_heads"]),
        in_channels=int(raw["in_channels"]), patch_size=int(raw["patch_size"]),
        spatial_merge_size=int(raw["spatial_merge_size"]), temporal_patch_size=int(raw["temporal_patch_size"]),
        num_position_embeddings=int(raw["num_position_embeddings"]),
        out_hidden_size=int(raw.get("out_hidden_size") or out_hidden_size),
        rope_theta=float(rope.get("rope_theta", raw["rope_theta"])), deepstack_visual_indexes=deepstack)
    if any(not 0 <= index < tower.depth for index in deepstack) or len(set(deepstack)) != len(deepstack):
        raise ValueError(f"vision deepstack_visual_indexes {list(deepstack)} must be distinct blocks of the "
                         f"{tower.depth}")
    side = round(tower.num_position_embeddings ** 0.5)
    if side * side != tower.num_position_embeddings:
        raise ValueError(f"vision num_position_embeddings ({tower.num_position_embeddings}) must be a square")
    if tower.hidden_size % tower.num_heads or tower.head_dim % 4:
        raise ValueError(f"vision hidden_size {tower.hidden_size} over {tower.num_heads} heads must give a head_dim "
                         "divisible by 4 (2-D rotary)")
    if tower.out_hidden_size != out_hidden_size:
        raise ValueError(f"vision out_hidden_size {tower.out_hidden_size} differs from the language model's hidden "
                         f"size {out_hidden_size}")
    return tower


def checkpoint_vision_spec(model_config: Any, model_path: Path | None) -> VisionSpec | None:
    """The VisionSpec of a loaded model (a `ModelConfig`) whose vision tower runs; None for a text-only one."""
    if model_config.vision_tower is None or model_path is None:
        return None
    return read_vision_spec(model_path, json.loads((Path(model_path) / CONFIG_FILE).read_text()))


def read_vision_spec(model_path: Path, config: dict[str, Any]) -> VisionSpec:
    """The checkpoint's placeholder ids and image preprocessing (its preprocessor_config.json if it has one,
    else transformers' defaults with the tower's patching)."""
    tower = dict(DEFAULT_VISION) | dict(config.get(VISION_CONFIG_KEY) or {})
    file = Path(model_path) / PREPROCESSOR_CONFIG
    preprocessor = json.loads(file.read_text()) if file.is_file() else {}
    patching = {"patch_size": int(tower["patch_size"]), "temporal_patch_size": int(tower["temporal_patch_size"]),
                "merge_size": int(tower["spatial_merge_size"])}
    for key, value in patching.items():
        if preprocessor.setdefault(key, value) != value:
            raise ValueError(f"{PREPROCESSOR_CONFIG}'s {key} ({preprocessor[key]}) differs from the vision tower's "
                             f"({value})")
    image, start, end = DEFAULT_PLACEHOLDER_IDS.get(config.get("model_type"), DEFAULT_PLACEHOLDER_IDS["qwen3_5"])
    return VisionSpec(
        image_token_id=int(config.get("image_token_id", image)),
        vision_start_token_id=int(config.get("vision_start_token_id", start)),
        vision_end_token_id=int(config.get("vision_end_token_id", end)),
        spatial_merge_size=patching["merge_size"], preprocessor=preprocessor)
