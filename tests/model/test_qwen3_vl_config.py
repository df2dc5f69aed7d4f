"""Qwen3-VL's config.json as mili reads it (model/qwen3_vl_config.py): a Qwen3 language model under `text_config`
with mRoPE sections and the top level's tied head, a vision tower with DeepStack; what mili does not run (the MoE
line, tensor parallelism, quantized weights) and inconsistent configs are refused at load, by name."""

from __future__ import annotations

import json

import pytest
import torch

from vision_helpers import TINY_QWEN3_VL_TEXT, TINY_QWEN3_VL_VISION

from mili_openai.model.config import ModelConfig
from mili_openai.model.loader import load_model
from mili_openai.model.qwen3_vl_config import QWEN3_VL_ARCHITECTURE


def _config(checkpoint) -> dict:
    return json.loads((checkpoint / "config.json").read_text())


def test_the_language_model_is_qwen3_with_mrope_and_deepstack(qwen3_vl_checkpoint):
    config = ModelConfig.from_pretrained(qwen3_vl_checkpoint)
    assert config.architecture == QWEN3_VL_ARCHITECTURE
    assert config.hybrid is None and config.moe is None
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 3, 32)
    assert config.rope_theta == TINY_QWEN3_VL_TEXT["rope_parameters"]["rope_theta"]
    assert config.tie_word_embeddings
    assert config.vision.mrope_section == (6, 5, 5)
    assert config.vision_tower.deepstack_visual_indexes == tuple(TINY_QWEN3_VL_VISION["deepstack_visual_indexes"])
    assert config.vision_tower.depth == TINY_QWEN3_VL_VISION["depth"]


def test_unsupported_qwen3_vl_options_are_refused(qwen3_vl_checkpoint):
    raw = _config(qwen3_vl_checkpoint)
    with pytest.raises(NotImplementedError, match="qwen3_vl_moe"):
        ModelConfig.from_dicts(raw | {"model_type": "qwen3_vl_moe"})
    with pytest.raises(NotImplementedError, match="quantization"):
        load_model(qwen3_vl_checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False,
                   quantization="int8")


@pytest.mark.parametrize("text, vision, message", [
    (dict(rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[6, 5, 4])), {}, "mrope_section"),
    ({}, dict(deepstack_visual_indexes=[0, 3]), "deepstack_visual_indexes"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=5e6)), {}, "rope type"),
])
def test_inconsistent_configs_are_refused(qwen3_vl_checkpoint, text, vision, message):
    raw = _config(qwen3_vl_checkpoint)
    raw["text_config"] |= text
    raw["vision_config"] |= vision
    with pytest.raises((ValueError, NotImplementedError), match=message):
        ModelConfig.from_dicts(raw)
