"""Qwen3-VL's config.json as mili reads it (model/qwen3_vl_config.py): a Qwen3 language model under `text_config`
with mRoPE sections and the top level's tied head, a vision tower with DeepStack; Qwen3-VL-MoE's Qwen3-MoE language
model and its experts from either stored layout; what mili does not run (tensor parallelism, quantized weights) and
inconsistent configs are refused at load, by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vision_helpers import TINY_QWEN3_VL_TEXT, TINY_QWEN3_VL_VISION

from mili_openai.model.config import ModelConfig
from mili_openai.model.loader import load_model
from mili_openai.model.qwen3_vl_checkpoint import STACKED_EXPERT_SUFFIXES, WEIGHTS_FILE
from mili_openai.model.qwen3_vl_config import QWEN3_VL_ARCHITECTURE, QWEN3_VL_MOE_ARCHITECTURE


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


def test_qwen3_vl_moe_is_qwen3_moe_with_the_same_vision_side(qwen3_vl_moe_checkpoint):
    config = ModelConfig.from_pretrained(qwen3_vl_moe_checkpoint)
    assert config.architecture == QWEN3_VL_MOE_ARCHITECTURE
    assert config.moe.norm_topk_prob  # transformers' router renormalises, whatever the config says
    assert (config.moe.num_experts, config.moe.num_experts_per_tok, config.moe.moe_intermediate_size) == (4, 2, 48)
    assert [config.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    assert config.vision.mrope_section == (6, 5, 5)
    assert config.vision_tower.deepstack_visual_indexes == tuple(TINY_QWEN3_VL_VISION["deepstack_visual_indexes"])
    raw = _config(qwen3_vl_moe_checkpoint)
    with pytest.raises(ValueError, match=QWEN3_VL_MOE_ARCHITECTURE):
        ModelConfig.from_dicts(raw | {"architectures": ["Qwen3VLForConditionalGeneration"]})


def test_qwen3_vl_moe_experts_load_from_either_stored_layout(qwen3_vl_moe_checkpoint, tmp_path):
    """Published checkpoints store the stacked experts transposed from transformers' modules (the fixture's), and
    transformers' save_pretrained in its modules' layout: both load to the same weights, as transformers loads them."""
    from safetensors.torch import load_file, save_file

    own_layout = tmp_path / "own-layout"
    shutil.copytree(qwen3_vl_moe_checkpoint, own_layout)
    weights = load_file(str(own_layout / WEIGHTS_FILE))
    stacked = [name for name in weights if name.endswith(STACKED_EXPERT_SUFFIXES)]
    assert stacked
    save_file({name: t.transpose(1, 2).contiguous() if name in stacked else t for name, t in weights.items()},
              str(own_layout / WEIGHTS_FILE))
    published, _ = load_model(qwen3_vl_moe_checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    own, _ = load_model(own_layout, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    experts = {name: t for name, t in published.state_dict().items() if ".experts." in name}
    assert experts and all(torch.equal(t, own.state_dict()[name]) for name, t in experts.items())
    gate_up = experts["model.layers.0.mlp.experts.gate_up_proj"]
    stored = weights["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up, stored.transpose(1, 2))  # (E, 2I, H) from the published (E, H, 2I)


def test_unsupported_qwen3_vl_options_are_refused(qwen3_vl_checkpoint):
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
