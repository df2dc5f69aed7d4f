"""`ModelConfig`: the architecture of a Qwen3, Qwen3-MoE, Qwen3.5 / Qwen3.6 (dense and MoE) or Qwen3-Next
checkpoint, read from its `config.json` and `generation_config.json`.

Defaults for absent keys follow transformers' config classes (the numerical oracle), not guesses: e.g. a
missing `head_dim` is 128 for Qwen3, 256 for the hybrids, not hidden_size / num_attention_heads. The hybrids'
own fields (layer types, linear attention, mRoPE) are read by model/hybrid_config.py into `ModelConfig.hybrid`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mili_openai.model.classifier_config import SEQUENCE_CLASSIFICATION, ClassifierConfig, read_classifier
from mili_openai.model.hybrid_config import (
    DEFAULT_HYBRID_HEAD_DIM,
    DEFAULT_SHARED_EXPERT_INTERMEDIATE_SIZE,
    HYBRID_ARCHITECTURES,
    QWEN3_5_MOE_TYPES,
    HybridConfig,
    is_hybrid,
    partial_rotary_factor,
    read_hybrid,
    text_dict,
)
from mili_openai.model.qwen3_vl_config import (
    QWEN3_VL_LINES,
    VisionLanguageConfig,
    is_qwen3_vl,
    qwen3_vl_text,
    read_vision_language,
)
from mili_openai.model.vision_config import VisionTowerConfig, read_vision_tower

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# model_type -> the architecture transformers builds for it
SUPPORTED_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_ARCHITECTURES)
SUPPORTED_ACTIVATION = "silu"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
MROPE_TYPE = "mrope"

# transformers' Qwen3Config defaults, used when a key is absent
DEFAULT_HEAD_DIM = 128
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
DEFAULT_RMS_NORM_EPS = 1e-6
# yarn's ramp bounds when the checkpoint leaves them out (the YaRN paper's values, as in transformers)
DEFAULT_YARN_BETA_FAST = 32.0
DEFAULT_YARN_BETA_SLOW = 1.0
# transformers' Qwen3MoeConfig defaults (the Qwen3-30B-A3B layout), used when a qwen3_moe config lacks a key
DEFAULT_NUM_EXPERTS = 128
DEFAULT_NUM_EXPERTS_PER_TOK = 8
DEFAULT_MOE_INTERMEDIATE_SIZE = 768
DEFAULT_DECODER_SPARSE_STEP = 1


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE settings. Only the fields of `rope_type` are meaningful; the rest stay None."""

    rope_type: str = "default"
    rope_theta: float = DEFAULT_ROPE_THETA
    factor: float | None = None  # linear, dynamic, yarn, llama3
    original_max_position_embeddings: int | None = None  # yarn, llama3: the pretraining context
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale; None = derived from factor/mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims
    partial_rotary_factor: float = 1.0  # the share of head_dim rotated (the hybrids: 0.25), the rest passes

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise NotImplementedError(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_type in ("linear", "dynamic", "llama3") and (self.factor is None or self.factor <= 0):
            raise ValueError(f"rope type {self.rope_type!r} needs a positive 'factor', got {self.factor}")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ValueError("rope type 'llama3' needs 'low_freq_factor' and 'high_freq_factor'")
        if self.rope_type == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise ValueError("rope type 'llama3' needs low_freq_factor != high_freq_factor")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Qwen3-MoE's sparse MLP: each token's router picks `num_experts_per_tok` of `num_experts` SwiGLU experts."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # renormalise the chosen experts' probabilities to sum to 1
    decoder_sparse_step: int  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (these keep a dense MLP)
    # Qwen3.5-MoE / Qwen3-Next: one more SwiGLU expert every token goes through, scaled by a sigmoid gate; 0: none
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")

    def is_sparse_layer(self, index: int) -> bool:
        """transformers' rule for which decoder layers hold experts."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None  # None: every layer has the dense MLP (Qwen3ForCausalLM)
    hybrid: HybridConfig | None = None  # Qwen3.5 / Qwen3.6 / Qwen3-Next: linear-attention layers among the others
    classifier: ClassifierConfig | None = None  # Qwen3ForSequenceClassification: a score head, no LM head
    vision: VisionLanguageConfig | None = None  # Qwen3-VL: a Qwen3 language model with mRoPE and a vision tower

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @property
    def rope_theta(self) -> float:
        return self.rope.rope_theta

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` holds experts rather than the dense MLP."""
        return self.moe is not None and self.moe.is_sparse_layer(index)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE rotates (all of head_dim for Qwen3)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def vision_tower(self) -> VisionTowerConfig | None:
        """The vision tower of a vision-language checkpoint (Qwen3.5 / Qwen3.6 or Qwen3-VL); None: text only."""
        if self.vision is not None:
            return self.vision.tower
        return self.hybrid.vision_tower if self.hybrid is not None else None

    @property
    def architecture(self) -> str:
        if self.vision is not None:
            return self.vision.architecture
        if self.hybrid is not None:
            return HYBRID_ARCHITECTURES[self.hybrid.model_type][0]
        if self.classifier is not None:
            return SEQUENCE_CLASSIFICATION
        return SUPPORTED_ARCHITECTURES["qwen3_moe" if self.moe is not None else "qwen3"]

    @classmethod
    def from_dicts(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        if is_hybrid(config):
            return _hybrid_config(config, generation_config)
        if is_qwen3_vl(config):  # a Qwen3 language model, then its vision side
            text = cls.from_dicts(qwen3_vl_text(config), generation_config)
            return dataclasses.replace(text, vision=read_vision_language(config, text.hidden_size, text.rotary_dim))
        _check_architecture(config)
        eos = (generation_config or {}).get("eos_token_id")
        if eos is None:
            eos = config.get("eos_token_id")
        bos = (generation_config or {}).get("bos_token_id", config.get("bos_token_id"))
        max_positions = int(config.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))
        heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or DEFAULT_HEAD_DIM),
            rms_norm_eps=float(config.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
            rope=_read_rope(config, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=_as_id_tuple(eos),
            bos_token_id=None if bos is None else int(bos),
            moe=_read_moe(config),
            classifier=read_classifier(config),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (required) and `generation_config.json` (optional) from a checkpoint dir."""
        directory = Path(path)
        config_path = directory / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{directory} is not a model checkpoint: it has no {CONFIG_FILE}")
        config = json.loads(config_path.read_text())
        generation_path = directory / GENERATION_CONFIG_FILE
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_dicts(config, generation)


def _hybrid_config(config: dict[str, Any], generation_config: dict[str, Any] | None) -> ModelConfig:
    """A Qwen3.5 / Qwen3.6 / Qwen3-Next config: the language model's fields, its hybrid layout, its experts."""
    model_type = config["model_type"]
    text = text_dict(config)
    _check_activation(text)
    head_dim = int(text.get("head_dim") or DEFAULT_HYBRID_HEAD_DIM)
    max_positions = int(text.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))
    rope = _read_rope(text, max_positions, partial_rotary_factor(text))
    hybrid = read_hybrid(model_type, text, int(head_dim * rope.partial_rotary_factor))
    if hybrid.vision:
        hybrid = dataclasses.replace(hybrid, vision_tower=read_vision_tower(config, int(text["hidden_size"])))
    moe = _read_hybrid_moe(model_type, text)
    heads = int(text["num_attention_heads"])
    eos = (generation_config or {}).get("eos_token_id")
    bos = (generation_config or {}).get("bos_token_id", text.get("bos_token_id"))
    return ModelConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        # Qwen3.5-MoE has no dense MLP: the field then holds the experts' size, which nothing reads
        intermediate_size=int(text.get("intermediate_size") or moe.moe_intermediate_size),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
        rope=rope,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        eos_token_ids=_as_id_tuple(eos if eos is not None else text.get("eos_token_id")),
        bos_token_id=None if bos is None else int(bos),
        moe=moe,
        hybrid=hybrid,
    )


def _read_hybrid_moe(model_type: str, text: dict[str, Any]) -> MoeConfig | None:
    """Qwen3.5-MoE: experts in every layer, top-k always renormalised (transformers' router has no switch).
    Qwen3-Next: Qwen3-MoE's placement rules (`decoder_sparse_step`, `mlp_only_layers`); no experts: dense."""
    if model_type in QWEN3_5_MOE_TYPES:
        sparse_step, only_dense, normalize = 1, (), True
    elif text.get("num_experts"):
        sparse_step = int(text.get("decoder_sparse_step") or DEFAULT_DECODER_SPARSE_STEP)
        only_dense = tuple(int(i) for i in text.get("mlp_only_layers") or ())
        normalize = bool(text.get("norm_topk_prob", True))
    else:
        return None
    shared = int(text.get("shared_expert_intermediate_size", DEFAULT_SHARED_EXPERT_INTERMEDIATE_SIZE))
    if shared < 1:
        raise NotImplementedError(f"shared_expert_intermediate_size={shared}: a sparse block without its shared "
                                  "expert is not supported")
    return MoeConfig(
        num_experts=int(text.get("num_experts") or DEFAULT_NUM_EXPERTS),
        num_experts_per_tok=int(text.get("num_experts_per_tok", DEFAULT_NUM_EXPERTS_PER_TOK)),
        moe_intermediate_size=int(text.get("moe_intermediate_size", DEFAULT_MOE_INTERMEDIATE_SIZE)),
        norm_topk_prob=normalize,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=only_dense,
        shared_expert_intermediate_size=shared,
    )


def _check_activation(config: dict[str, Any]) -> None:
    activation = config.get("hidden_act", SUPPORTED_ACTIVATION)
    if activation != SUPPORTED_ACTIVATION:
        raise NotImplementedError(f"hidden_act {activation!r} is not supported (Qwen uses {SUPPORTED_ACTIVATION!r})")


def _check_architecture(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; this server runs "
                         f"{SUPPORTED_MODEL_TYPES + tuple(HYBRID_ARCHITECTURES) + tuple(QWEN3_VL_LINES)}")
    architectures = config.get("architectures") or [SUPPORTED_ARCHITECTURES[model_type]]
    served = (SUPPORTED_ARCHITECTURES[model_type], *((SEQUENCE_CLASSIFICATION,) if model_type == "qwen3" else ()))
    if not set(served) & set(architectures):
        raise ValueError(f"architectures {architectures} are not supported for model_type {model_type!r}; "
                         f"this server runs {' or '.join(served)}")
    _check_activation(config)
    # Real Qwen3 checkpoints have neither; refusing beats silently computing a different model.
    if config.get("attention_bias"):
        raise NotImplementedError("attention_bias=True is not supported (Qwen3 projections have no bias)")
    if config.get("use_sliding_window"):
        raise NotImplementedError("use_sliding_window=True is not supported (full attention only)")


def _read_moe(config: dict[str, Any]) -> MoeConfig | None:
    """The experts of a qwen3_moe config (None for qwen3, or for a MoE config with no experts, which
    transformers builds with dense MLPs only). transformers 5 writes `num_experts` as `num_local_experts`."""
    if config.get("model_type") != "qwen3_moe":
        return None
    num_experts = config.get("num_experts", config.get("num_local_experts", DEFAULT_NUM_EXPERTS))
    if not num_experts:
        return None
    return MoeConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(config.get("num_experts_per_tok", DEFAULT_NUM_EXPERTS_PER_TOK)),
        moe_intermediate_size=int(config.get("moe_intermediate_size", DEFAULT_MOE_INTERMEDIATE_SIZE)),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(config.get("decoder_sparse_step") or DEFAULT_DECODER_SPARSE_STEP),
        mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
    )


def _read_rope(config: dict[str, Any], max_positions: int, partial_rotary: float | None = None) -> RopeScaling:
    """Merge both spellings: transformers 5.x `rope_parameters` and the older top-level `rope_theta` plus
    `rope_scaling` that real Qwen3 checkpoints carry. Explicit `rope_parameters` entries win.
    `partial_rotary`: the hybrids' share of head_dim rotated; None: Qwen3, which rotates every dim."""
    params: dict[str, Any] = {}
    params.update(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    if "type" in params and "rope_type" not in params:  # the oldest spelling
        params["rope_type"] = params["type"]
    rope_type = params.get("rope_type", "default")
    if rope_type == MROPE_TYPE:  # the Qwen2-VL spelling of mRoPE, whose text positions make it default RoPE
        rope_type = "default"
    theta = params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial_rotary is not None:
        partial = partial_rotary
    elif partial != 1.0:
        raise NotImplementedError(f"partial_rotary_factor={partial} is not supported (Qwen3 rotates all dims)")
    original = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and original is None:
        original = max_positions  # what transformers assumes when the checkpoint leaves it out
    factor = params.get("factor")
    if rope_type == "yarn" and factor is None:
        factor = max_positions / original
    return RopeScaling(
        rope_type=rope_type,
        rope_theta=float(theta),
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=_optional_float(params.get("low_freq_factor")),
        high_freq_factor=_optional_float(params.get("high_freq_factor")),
        beta_fast=float(params.get("beta_fast") or DEFAULT_YARN_BETA_FAST) if rope_type == "yarn" else None,
        beta_slow=float(params.get("beta_slow") or DEFAULT_YARN_BETA_SLOW) if rope_type == "yarn" else None,
        attention_factor=_optional_float(params.get("attention_factor")),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(partial),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
