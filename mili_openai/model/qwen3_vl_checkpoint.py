"""Random Qwen3-VL and Qwen3-VL-MoE checkpoints (`Qwen3VLForConditionalGeneration`,
`Qwen3VLMoeForConditionalGeneration`), written by transformers' own class (`save_pretrained`), so they carry exactly
the config keys and weight names real ones do: the Qwen3 (Qwen3-MoE) language model under `model.language_model.`,
the vision tower with its DeepStack mergers under `model.visual.`, the real Qwen3 tokenizer files (their vocabulary
holds Qwen3-VL's placeholder tokens) with a chat template of Qwen3-VL's shape, and a preprocessor_config.json. A MoE checkpoint's stacked experts are then
stored as published checkpoints store them, transposed from transformers' modules: gate_up (E, H, 2I), down (E, I, H).

Weights are drawn as model/checkpoint.py draws Qwen3's: norm weights around 1, matrices with std 1/sqrt(fan_in).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mili_openai.model.checkpoint import (
    SAFETENSORS_METADATA,
    _draw,
    _write_generation_config_and_tokenizer,
    draw_and_save,
)
from mili_openai.model.hybrid_checkpoint import QWEN3_5_PREPROCESSOR_CONFIG, TINY_VISION_CONFIG

PREPROCESSOR_FILE = "preprocessor_config.json"
# Qwen3-VL-Instruct's template shape (Qwen3's text one cannot place images): transformers' tokenizer reads
# chat_template.jinja over tokenizer_config.json's template
CHAT_TEMPLATE_SOURCE = Path(__file__).with_name("qwen3_vl_chat_template.jinja")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
WEIGHTS_FILE = "model.safetensors"  # a tiny checkpoint fits one shard
STACKED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def build_random_qwen3_vl_checkpoint(path: str | Path, text_fields: dict[str, Any], vision_fields: dict[str, Any],
                                     seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """A checkpoint dir at `path`: transformers' `Qwen3VLConfig` (`Qwen3VLMoeConfig` when `text_fields` has
    `num_experts`) from `text_fields` (its text_config, with `tie_word_embeddings`) and `vision_fields` (over a
    tiny tower: TINY_VISION_CONFIG), weights drawn from `seed`."""
    import transformers

    fields = dict(text_fields)
    tie = bool(fields.pop("tie_word_embeddings", False))
    vision = TINY_VISION_CONFIG | dict(out_hidden_size=fields["hidden_size"]) | vision_fields
    moe = bool(fields.get("num_experts"))
    config_class, model_class = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
                                 if moe else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    config = config_class(text_config=fields, vision_config=vision, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    directory = Path(path)
    draw_and_save(model, directory, seed, _draw, tie)
    if moe:
        _store_experts_published(directory / WEIGHTS_FILE)
    _write_generation_config_and_tokenizer(directory)
    shutil.copyfile(CHAT_TEMPLATE_SOURCE, directory / CHAT_TEMPLATE_FILE)
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(QWEN3_5_PREPROCESSOR_CONFIG, indent=2))
    return directory


def _store_experts_published(weights_file: Path) -> None:
    """Rewrite the stacked experts transposed, as published Qwen3-VL-MoE checkpoints hold them (transformers
    transposes them back as it loads)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(weights_file))
    for name in [n for n in weights if n.endswith(STACKED_EXPERT_SUFFIXES)]:
        weights[name] = weights[name].transpose(1, 2).contiguous()
    save_file(weights, str(weights_file), metadata=SAFETENSORS_METADATA)
