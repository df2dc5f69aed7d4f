"""Random Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints, written by transformers' own classes (`save_pretrained`),
so they carry exactly the config keys and weight names real ones do.

Five layouts: `qwen3_5` (`Qwen3_5ForCausalLM`, the text model at the top level), `qwen3_5_vl`
(`Qwen3_5ForConditionalGeneration`: the language model under `model.language_model.`, a tiny vision tower
beside it, Qwen3.5's preprocessor_config.json), `qwen3_5_moe` (`Qwen3_5MoeForCausalLM`), `qwen3_5_moe_vl`
(`Qwen3_5MoeForConditionalGeneration`, as `qwen3_5_vl` with the MoE language model) and `qwen3_next`
(`Qwen3NextForCausalLM`, fused `in_proj_qkvz` / `in_proj_ba`). Each also gets the multi-token-prediction weights real checkpoints ship
(`mtp.*`, which transformers' classes do not build): a (hidden, 2 * hidden) `fc`, three norms and one
full-attention decoder layer per `mtp_num_hidden_layers`.

Weights are drawn so every part of the model matters to the logits (see checkpoint.random_weights): matrices
with std 1/sqrt(fan_in), zero-centred norm weights around 0 (applied as 1 + w), the gated norm's around 1,
decay rates A = exp(A_log) in [0.05, 2] so a linear layer's state remembers over tens of tokens.

The tokenizer files are Qwen3's (QWEN3_TOKENIZER: what most tests need, a small vocabulary suffices) or Qwen3.5's
own (QWEN35_TOKENIZER: its 248,320-row vocabulary, chat template and XML tool calls, for the server path and the
embedded `mili-tiny-random-qwen3.5`; model/qwen35_tokenizer.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mili_openai.model.checkpoint import (
    NORM_WEIGHT_STD,
    SAFETENSORS_METADATA,
    _draw,
    _write_generation_config_and_tokenizer,
    draw_and_save,
)
from mili_openai.model.qwen35_tokenizer import (
    ADDED_TOKENS,
    ADDED_TOKENS_START,
    ENDOFTEXT,
    EOS_TOKEN_IDS,
    write_qwen35_tokenizer_files,
)

HYBRID_LAYOUTS = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next")
VISION_LANGUAGE_LAYOUTS = ("qwen3_5_vl", "qwen3_5_moe_vl")  # a vision tower beside the language model
QWEN3_TOKENIZER, QWEN35_TOKENIZER = "qwen3", "qwen3.5"  # which tokenizer files a checkpoint carries
DECAY_RATE_RANGE = (0.05, 2.0)  # A = exp(A_log): per-token decay exp(-A * softplus(a + dt_bias))
DT_BIAS_STD = 0.5
GATED_NORM = "linear_attn.norm.weight"  # the one norm that is not zero-centred
TINY_VISION_CONFIG: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
MTP_NORMS = ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
# Qwen3.5's preprocessor_config.json (the vision-language layout ships it): 256 * 256 to 4096 * 4096 pixels
QWEN3_5_PREPROCESSOR_CONFIG: dict[str, Any] = dict(
    size=dict(longest_edge=16777216, shortest_edge=65536), patch_size=16, temporal_patch_size=2, merge_size=2,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], processor_class="Qwen3VLProcessor",
    image_processor_type="Qwen2VLImageProcessorFast")
# Qwen3.5-0.8B's text config (config.json's text_config), for benchmarks and the embedded default model
QWEN3_5_0_8B_CONFIG: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                         mrope_interleaved=True),
    mtp_num_hidden_layers=1)
# Qwen3.5-0.8B's vision tower (config.json's vision_config), for the vision benchmark
QWEN3_5_0_8B_VISION_CONFIG: dict[str, Any] = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)


def _transformers_model(layout: str, fields: dict[str, Any], tie: bool, vision_fields: dict[str, Any]):
    """transformers' model for `layout`, built on the meta device."""
    import transformers

    fields = dict(fields)
    mtp_layers = fields.pop("mtp_num_hidden_layers", 0)
    if layout in VISION_LANGUAGE_LAYOUTS:
        vision = TINY_VISION_CONFIG | vision_fields | dict(out_hidden_size=fields["hidden_size"])
        config_class, model_class = {
            "qwen3_5_vl": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe_vl": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
        }[layout]
        config = config_class(text_config=dict(fields, mtp_num_hidden_layers=mtp_layers), vision_config=vision,
                              tie_word_embeddings=tie)
    else:
        config_class, model_class = {
            "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
            "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
            "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        }[layout]
        config = config_class(**fields, tie_word_embeddings=tie)
        config.mtp_num_hidden_layers = mtp_layers  # config.json carries it; transformers' classes ignore it
    with torch.device("meta"):
        return model_class(config)


def _draw_hybrid(name: str, dims: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        low, high = DECAY_RATE_RANGE
        return (low + (high - low) * torch.rand(dims, generator=generator)).log()
    if name.endswith("dt_bias"):
        return DT_BIAS_STD * torch.randn(dims, generator=generator)
    if name.endswith("norm.weight") and not name.endswith(GATED_NORM) and "visual" not in name:
        return NORM_WEIGHT_STD * torch.randn(dims, generator=generator)  # zero-centred: applied as 1 + w
    if name.endswith("conv1d.weight"):  # (channels, 1, kernel): fan-in is the kernel
        return torch.randn(dims, generator=generator) / math.sqrt(dims[-1])
    return _draw(name, dims, generator)


def _mtp_weights(state: dict[str, torch.Tensor], config, layers: int, generator: torch.Generator,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`mtp.*` as real checkpoints name them: fc, three norms, and copies of a full-attention layer's tensors
    (redrawn) as each MTP layer."""
    text = config.get_text_config()
    hidden = text.hidden_size
    source = next(index for index, kind in enumerate(text.layer_types) if kind == "full_attention")
    layer_prefix = next(name for name in state if f"layers.{source}." in name).split(f"layers.{source}.")[0]
    shapes = {"fc.weight": (hidden, 2 * hidden)} | {f"{norm}.weight": (hidden,) for norm in MTP_NORMS}
    for index in range(layers):
        for name, tensor in state.items():
            if name.startswith(f"{layer_prefix}layers.{source}."):
                shapes[f"layers.{index}." + name.removeprefix(f"{layer_prefix}layers.{source}.")] = tuple(tensor.shape)
    return {f"mtp.{name}": _draw_hybrid(name, dims, generator).to(dtype) for name, dims in shapes.items()}


def build_random_hybrid_checkpoint(path: str | Path, layout: str, config_fields: dict[str, Any], seed: int,
                                   dtype: torch.dtype = torch.float32, tokenizer: str = QWEN3_TOKENIZER,
                                   vision_fields: dict[str, Any] | None = None) -> Path:
    """A checkpoint dir at `path` in `layout` (HYBRID_LAYOUTS): transformers' config from `config_fields` (the
    text config's fields, plus `mtp_num_hidden_layers`), its model's weights drawn from `seed`, saved by
    `save_pretrained`, the MTP weights added, generation config and `tokenizer`'s files beside (QWEN3_TOKENIZER
    or QWEN35_TOKENIZER). `vision_fields`: a vision-language layout's tower, over TINY_VISION_CONFIG."""
    if layout not in HYBRID_LAYOUTS:
        raise ValueError(f"layout must be one of {HYBRID_LAYOUTS}, got {layout!r}")
    if tokenizer not in (QWEN3_TOKENIZER, QWEN35_TOKENIZER):
        raise ValueError(f"tokenizer must be {QWEN3_TOKENIZER!r} or {QWEN35_TOKENIZER!r}, got {tokenizer!r}")
    fields = dict(config_fields)
    tie = bool(fields.pop("tie_word_embeddings", False))
    model = _transformers_model(layout, fields, tie, vision_fields or {}).to(dtype)
    directory = Path(path)
    generator = draw_and_save(model, directory, seed, _draw_hybrid, tie)
    mtp_layers = config_fields.get("mtp_num_hidden_layers", 0)
    if mtp_layers:
        weights_file = directory / "model.safetensors"
        weights = load_file(str(weights_file))
        weights.update(_mtp_weights(model.state_dict(), model.config, mtp_layers, generator, dtype))
        save_file(weights, str(weights_file), metadata=SAFETENSORS_METADATA)
    if tokenizer == QWEN35_TOKENIZER:
        write_qwen35_generation_config_and_tokenizer(directory)
    else:
        _write_generation_config_and_tokenizer(directory)
    if layout in VISION_LANGUAGE_LAYOUTS:
        (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_5_PREPROCESSOR_CONFIG, indent=2))
    return directory


def write_qwen35_generation_config_and_tokenizer(directory: Path) -> None:
    """Qwen3.5's end-of-turn ids in generation_config.json, its tokenizer files and chat template."""
    pad = ADDED_TOKENS_START + ADDED_TOKENS.index(ENDOFTEXT)
    generation = {"eos_token_id": list(EOS_TOKEN_IDS), "pad_token_id": pad}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_qwen35_tokenizer_files(directory)

