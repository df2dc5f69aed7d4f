"""What a Qwen3-VL checkpoint (`Qwen3VLForConditionalGeneration`, model_type `qwen3_vl`) adds to a Qwen3 one.

Its language model is Qwen3 (q/k-normed attention in every layer, SwiGLU MLPs) under `text_config`, with mRoPE:
each rotary pair reads the temporal, height or width stream of a token's position, interleaved as transformers'
`Qwen3VLTextRotaryEmbedding` recomposes them (the same rule as Qwen3.5's). Beside it, the vision tower of
model/qwen3_5_vision.py with DeepStack: the features of some tower blocks, each through its own merger, are added to
the hidden states of the first decoder layers at the image tokens.

Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, model_type `qwen3_vl_moe`) is the same with a Qwen3-MoE
language model: its router always renormalises the chosen experts' weights (transformers' has no switch).

`qwen3_vl_text` turns config.json into the Qwen3 (or Qwen3-MoE) config.json its language model is, for
`ModelConfig` to read as any Qwen3; `read_vision_language` reads the rest. transformers (5.x) is the oracle for
defaults: `Qwen3VLConfig`, `Qwen3VLMoeConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mili_openai.model.hybrid_config import TEXT_CONFIG_KEY, read_mrope_section, rope_parameters
from mili_openai.model.vision_config import VISION_CONFIG_KEY, VisionTowerConfig, read_vision_tower

QWEN3_VL_TYPE = "qwen3_vl"
QWEN3_VL_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE_TYPE = "qwen3_vl_moe"
QWEN3_VL_MOE_ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
# model_type -> (its architecture, what its language model is as mili reads it: model_type and architecture)
QWEN3_VL_LINES = {
    QWEN3_VL_TYPE: (QWEN3_VL_ARCHITECTURE, "qwen3", "Qwen3ForCausalLM"),
    QWEN3_VL_MOE_TYPE: (QWEN3_VL_MOE_ARCHITECTURE, "qwen3_moe", "Qwen3MoeForCausalLM"),
}
# transformers' Qwen3VLTextConfig defaults where they differ from Qwen3's
DEFAULT_MROPE_SECTION = (24, 20, 20)
DEFAULT_ROPE_THETA = 500000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 128000


@dataclass(frozen=True, slots=True)
class VisionLanguageConfig:
    """A Qwen3-VL model's vision side: its tower (with DeepStack) and the language model's mRoPE sections."""

    model_type: str  # qwen3_vl or qwen3_vl_moe
    tower: VisionTowerConfig
    mrope_section: tuple[int, ...]  # rotary pairs per position stream (temporal, height, width)

    @property
    def architecture(self) -> str:
        return QWEN3_VL_LINES[self.model_type][0]


def is_qwen3_vl(config: dict[str, Any]) -> bool:
    """A Qwen3-VL or Qwen3-VL-MoE config."""
    return config.get("model_type") in QWEN3_VL_LINES


def qwen3_vl_text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config as a Qwen3 (Qwen3-MoE) config.json: `text_config`, with the top level's token
    ids where it lacks them and the top level's tie_word_embeddings (transformers ties the head by the outer
    config)."""
    model_type = config["model_type"]
    architecture, text_type, text_architecture = QWEN3_VL_LINES[model_type]
    architectures = config.get("architectures") or [architecture]
    if architecture not in architectures:
        raise ValueError(f"architectures {architectures} are not supported for model_type {model_type!r}; this "
                         f"server runs {architecture}")
    text = config.get(TEXT_CONFIG_KEY)
    if not isinstance(text, dict):
        raise ValueError(f"a {model_type!r} checkpoint's config.json needs a {TEXT_CONFIG_KEY!r} object")
    merged = dict(text, model_type=text_type, architectures=[text_architecture])
    if model_type == QWEN3_VL_MOE_TYPE:
        merged["norm_topk_prob"] = True  # transformers' Qwen3VLMoeTextTopKRouter always renormalises
    for key in ("eos_token_id", "bos_token_id"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    merged["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    merged.setdefault("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
    rope = rope_parameters(text)
    rope.setdefault("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise NotImplementedError(f"Qwen3-VL rope type {rope.get('rope_type')!r} is not supported (only default "
                                  "mRoPE)")
    merged["rope_parameters"], merged["rope_scaling"] = rope, None
    return merged


def read_vision_language(config: dict[str, Any], hidden_size: int, rotary_dim: int) -> VisionLanguageConfig:
    """The vision tower (DeepStack included) and mRoPE sections of a Qwen3-VL config.json; ValueError for sections
    that do not cover the rotary pairs, NotImplementedError for what mili does not run."""
    rope = {"mrope_section": DEFAULT_MROPE_SECTION, **rope_parameters(config[TEXT_CONFIG_KEY])}
    section = read_mrope_section({"rope_parameters": rope}, rotary_dim)
    model_type = config["model_type"]
    if not config.get(VISION_CONFIG_KEY):
        raise ValueError(f"a {model_type!r} checkpoint's config.json needs a {VISION_CONFIG_KEY!r} object")
    tower = read_vision_tower(config, hidden_size, allow_deepstack=True)
    return VisionLanguageConfig(model_type=model_type, tower=tower, mrope_section=section)
