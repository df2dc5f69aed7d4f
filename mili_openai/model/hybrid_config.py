"""What Qwen3.5, Qwen3.6 and Qwen3-Next add to a Qwen3 config: the hybrid layer layout (Gated DeltaNet linear
attention in three of every four layers, gated full attention in the fourth), read from `config.json` and
checked.

transformers (5.x) is the oracle for defaults and meaning: `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig` and
`Qwen3NextConfig`. `Qwen3_5ForConditionalGeneration` checkpoints nest the language model's config under
`text_config` (`text_dict` unwraps it); `Qwen3_5ForCausalLM` ones keep it at the top level.

Every option mili does not implement is refused here, by name, before any weight is read: a checkpoint never
loads into wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mili_openai.model.vision_config import VisionTowerConfig

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
TEXT_CONFIG_KEY = "text_config"
# model_type -> the architectures transformers builds for it (the nested `text_config`'s type in parentheses)
HYBRID_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration",),  # text_config: qwen3_5_text
    "qwen3_5_text": ("Qwen3_5ForCausalLM",),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration",),  # text_config: qwen3_5_moe_text
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM",),
    "qwen3_next": ("Qwen3NextForCausalLM",),
}
HYBRID_MODEL_TYPES = tuple(HYBRID_ARCHITECTURES)
VISION_LANGUAGE_TYPES = ("qwen3_5", "qwen3_5_moe")  # a language model under `text_config`, a vision tower beside
QWEN3_5_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # every layer sparse, top-k always renormalised
FUSED_PROJECTION_TYPES = ("qwen3_next",)  # in_proj_qkvz / in_proj_ba, interleaved per key head

# transformers' defaults for absent keys (Qwen3_5TextConfig / Qwen3NextConfig)
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_CONV_KERNEL_DIM = 4
DEFAULT_LINEAR_HEAD_DIM = 128
DEFAULT_LINEAR_KEY_HEADS = 16
DEFAULT_LINEAR_VALUE_HEADS = 32
DEFAULT_HYBRID_HEAD_DIM = 256
DEFAULT_SHARED_EXPERT_INTERMEDIATE_SIZE = 512
MROPE_STREAMS = 3  # temporal, height, width


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """A Gated DeltaNet layer's shapes: GVA, each key/query head serving num_value_heads // num_key_heads
    value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, else Qwen3.5's four in_proj_*

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention's {name} must be >= 1, got {getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """The hybrid layout of a Qwen3.5 / Qwen3.6 / Qwen3-Next language model."""

    model_type: str  # the checkpoint's top-level model_type
    layer_types: tuple[str, ...]  # LINEAR_ATTENTION or FULL_ATTENTION per decoder layer
    linear: LinearAttentionConfig
    mrope_section: tuple[int, ...] | None  # rotary pairs per position stream; None: plain RoPE (Qwen3-Next)
    mtp_num_hidden_layers: int  # multi-token-prediction layers the checkpoint may carry (the "mtp" drafter)
    vision: bool  # a vision tower beside the language model
    vision_tower: VisionTowerConfig | None = None  # its shape (config.json's vision_config), where `vision`

    def layer_type(self, index: int) -> str:
        return self.layer_types[index]

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)


def is_hybrid(config: dict[str, Any]) -> bool:
    return config.get("model_type") in HYBRID_MODEL_TYPES


def text_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` for a vision-language checkpoint, else the whole dict.
    Top-level token ids (eos, bos) fill in where the text config lacks them; the top level's
    tie_word_embeddings decides."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or list(HYBRID_ARCHITECTURES[model_type][:1])
    if not set(architectures) & set(HYBRID_ARCHITECTURES[model_type]):
        raise ValueError(f"architectures {architectures} are not supported for model_type {model_type!r}; this "
                         f"server runs {HYBRID_ARCHITECTURES[model_type]}")
    if model_type not in VISION_LANGUAGE_TYPES:
        return config
    text = config.get(TEXT_CONFIG_KEY)
    if not isinstance(text, dict):
        raise ValueError(f"a {model_type!r} checkpoint's config.json needs a {TEXT_CONFIG_KEY!r} object")
    merged = dict(text)
    for key in ("eos_token_id", "bos_token_id"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    # transformers ties the LM head by the outer config's flag (the ConditionalGeneration model's)
    merged["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    return merged


def read_hybrid(model_type: str, text: dict[str, Any], rotary_dim: int) -> HybridConfig:
    """The hybrid fields of the language model's config `text` (see `text_dict`); raises NotImplementedError
    naming any option mili does not implement, ValueError for an inconsistent config."""
    _refuse_unsupported(text)
    layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' rule: every `full_attention_interval`-th layer attends
        interval = int(text.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"layer types {unknown} are not supported; mili runs {LAYER_TYPES}")
    if len(layer_types) != layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {layers}")
    if FULL_ATTENTION not in layer_types:
        raise NotImplementedError("a hybrid model without any full-attention layer is not supported (the engine "
                                  "bounds each sequence by its KV pages)")
    linear = LinearAttentionConfig(
        num_key_heads=int(text.get("linear_num_key_heads") or DEFAULT_LINEAR_KEY_HEADS),
        num_value_heads=int(text.get("linear_num_value_heads") or DEFAULT_LINEAR_VALUE_HEADS),
        key_head_dim=int(text.get("linear_key_head_dim") or DEFAULT_LINEAR_HEAD_DIM),
        value_head_dim=int(text.get("linear_value_head_dim") or DEFAULT_LINEAR_HEAD_DIM),
        conv_kernel_dim=int(text.get("linear_conv_kernel_dim") or DEFAULT_CONV_KERNEL_DIM),
        fused_projections=model_type in FUSED_PROJECTION_TYPES,
    )
    return HybridConfig(
        model_type=model_type,
        layer_types=tuple(layer_types),
        linear=linear,
        mrope_section=read_mrope_section(text, rotary_dim),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or 0),
        vision=model_type in VISION_LANGUAGE_TYPES,
    )


def rope_parameters(text: dict[str, Any]) -> dict[str, Any]:
    """Both spellings merged (transformers 5's `rope_parameters`, the older `rope_scaling`)."""
    return {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}


def partial_rotary_factor(text: dict[str, Any]) -> float:
    """The share of head_dim that RoPE rotates (transformers' default for these models: 0.25)."""
    factor = rope_parameters(text).get("partial_rotary_factor", text.get("partial_rotary_factor"))
    factor = DEFAULT_PARTIAL_ROTARY_FACTOR if factor is None else float(factor)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def read_mrope_section(text: dict[str, Any], rotary_dim: int) -> tuple[int, ...] | None:
    """mRoPE's rotary pairs per position stream (temporal, height, width). For text all three streams are the
    token position, so whichever stream a pair reads, its angle is the same: mRoPE is then exactly partial RoPE.
    The sections must still cover the rotary pairs, as transformers' recomposition assumes."""
    section = rope_parameters(text).get("mrope_section")
    if section is None:
        return None
    section = tuple(int(s) for s in section)
    if len(section) != MROPE_STREAMS or any(s < 0 for s in section) or sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must be {MROPE_STREAMS} sizes summing to the rotary pairs "
                         f"({rotary_dim // 2} = head_dim * partial_rotary_factor / 2)")
    return section


def _refuse_unsupported(text: dict[str, Any]) -> None:
    """Options transformers' classes or released checkpoints may carry that mili does not implement."""
    if text.get("attn_output_gate") is False:  # transformers always gates; vLLM honours False: both refuse to guess
        raise NotImplementedError("attn_output_gate=False is not supported (Qwen3.5/Qwen3-Next attention is gated)")
    if text.get("attention_bias"):
        raise NotImplementedError("attention_bias=True is not supported (the projections have no bias)")
    if text.get("use_sliding_window") or text.get("sliding_window_pattern"):
        raise NotImplementedError("sliding-window attention is not supported (full attention only)")
