"""Random Qwen3-VL checkpoints (`Qwen3VLForConditionalGeneration`), written by transformers' own class
(`save_pretrained`), so they carry exactly the config keys and weight names real ones do: the Qwen3 language model
under `model.language_model.`, the vision tower with its DeepStack mergers under `model.visual.`, the real Qwen3
tokenizer files (their vocabulary holds Qwen3-VL's placeholder tokens) and a preprocessor_config.json.

Weights are drawn as model/checkpoint.py draws Qwen3's: norm weights around 1, matrices with std 1/sqrt(fan_in).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mili_openai.model.checkpoint import _draw, _write_generation_config_and_tokenizer, draw_and_save
from mili_openai.model.hybrid_checkpoint import QWEN3_5_PREPROCESSOR_CONFIG, TINY_VISION_CONFIG

PREPROCESSOR_FILE = "preprocessor_config.json"


def build_random_qwen3_vl_checkpoint(path: str | Path, text_fields: dict[str, Any], vision_fields: dict[str, Any],
                                     seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """A checkpoint dir at `path`: transformers' `Qwen3VLConfig` from `text_fields` (its text_config, with
    `tie_word_embeddings`) and `vision_fields` (over a tiny tower: TINY_VISION_CONFIG), weights drawn from `seed`."""
    import transformers

    fields = dict(text_fields)
    tie = bool(fields.pop("tie_word_embeddings", False))
    vision = TINY_VISION_CONFIG | dict(out_hidden_size=fields["hidden_size"]) | vision_fields
    config = transformers.Qwen3VLConfig(text_config=fields, vision_config=vision, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(config).to(dtype)
    directory = Path(path)
    draw_and_save(model, directory, seed, _draw, tie)
    _write_generation_config_and_tokenizer(directory)
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(QWEN3_5_PREPROCESSOR_CONFIG, indent=2))
    return directory
