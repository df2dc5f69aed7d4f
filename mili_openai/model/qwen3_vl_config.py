"""What a Qwen3-VL checkpoint (`Qwen3VLForConditionalGeneration`, model_type `qwen3_vl`) adds to a Qwen3 one.

Its language model is Qwen3 (q/k-normed attention in every layer, SwiGLU MLPs) under `text_config`, with mRoPE:
each rotary pair reads the temporal, height or width stream of a token's position, interleaved as transformers'
`Qwen3VLTextRotaryEmbedding` recomposes them (the same rule as Qwen3.5's). Beside it, the vision tower of
model/qwen3_5_vision.py with DeepStack: the features of some tower blocks, each through its own merger, are added to
the hidden states of the first decoder layers at the image tokens.

`qwen3_vl_text` turns config.json into the Qwen3 config.json its language model is, for `ModelConfig` to read as
any Qwen3; `read_vision_language` reads the rest. transformers (5.x) is the oracle for defaults: `Qwen3VLConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mili_openai.model.hybrid_config import TEXT_CONFIG_KEY, read_mrope_section, rope_parameters
from mili_openai.model.vision_config import VISION_CONFIG_KEY, VisionTowerConfig, read_vision_tower

QWEN3_VL_TYPE = "qwen3_vl"
QWEN3_VL_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE_TYPE = "qwen3_vl_moe"
TEXT_MODEL_TYPE = "qwen3"  # what the language model is, as mili reads it
TEXT_ARCHITECTURE = "Qwen3ForCausalLM"
# transformers' Qwen3VLTextConfig defaults where they differ from Qwen3's
DEFAULT_MROPE_SECTION = (24, 20, 20)
DEFAULT_ROPE_THETA = 500000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 128000


@dataclass(frozen=True, slots=True)
class VisionLanguageConfig:
    """A Qwen3-VL model's vision side: its tower (with DeepStack) and the language model's mRoPE sections."""

    model_type: str
    tower: VisionTowerConfig
    mrope_section: tuple[int, ...]  # rotary pairs per position stream (temporal, height, width)


def is_qwen3_vl(config: dict[str, Any]) -> bool:
    """A Qwen3-VL config; a Qwen3-VL-MoE one is refused here, by name (its experts' layout is not mapped yet)."""
    if config.get("model_type") == QWEN3_VL_MOE_TYPE:
        raise NotImplementedError("Qwen3VLMoeForConditionalGeneration (model_type 'qwen3_vl_moe') is not supported "
                                  f"yet; mili runs the dense {QWEN3_VL_ARCHITECTURE}")
    return config.get("model_type") == QWEN3_VL_TYPE


def qwen3_vl_text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config as a Qwen3 config.json: `text_config`, with the top level's token ids where it
    lacks them and the top level's tie_word_embeddings (transformers ties the head by the outer config)."""
    architectures = config.get("architectures") or [QWEN3_VL_ARCHITECTURE]
    if QWEN3_VL_ARCHITECTURE not in architectures:
        raise ValueError(f"architectures {architectures} are not supported for model_type {QWEN3_VL_TYPE!r}; this "
                         f"server runs {QWEN3_VL_ARCHITECTURE}")
    text = config.get(TEXT_CONFIG_KEY)
    if not isinstance(text, dict):
        raise ValueError(f"a {QWEN3_VL_TYPE!r} checkpoint's config.json needs a {TEXT_CONFIG_KEY!r} object")
    merged = dict(text, model_type=TEXT_MODEL_TYPE, architectures=[TEXT_ARCHITECTURE])
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
    if not config.get(VISION_CONFIG_KEY):
        raise ValueError(f"a {QWEN3_VL_TYPE!r} checkpoint's config.json needs a {VISION_CONFIG_KEY!r} object")
    tower = read_vision_tower(config, hidden_size, allow_deepstack=True)
    return VisionLanguageConfig(model_type=QWEN3_VL_TYPE, tower=tower, mrope_section=section)
