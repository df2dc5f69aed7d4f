"""Loading Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints: the config fields read, every option mili does not run
refused by name at start, the vision-language layout's language model (its tower loaded beside), the MTP weights
kept, mRoPE with text positions equal to partial RoPE, and the cache specs' per-sequence memory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybrid_helpers import TINY_HYBRID_CONFIG, hybrid_caches, hybrid_tokens, transformers_class, with_state_slots
from model_helpers import PagedSequences

from mili_openai.model import CheckpointError, ModelConfig, load_model
from mili_openai.model.cache_spec import PagedKVSpec, RecurrentStateSpec
from mili_openai.model.rope import RotaryEmbedding
from mili_openai.model.state_cache import StateCache

CPU = torch.device("cpu")
FP32_ATOL = 2e-4


def edited_copy(source, target, edit) -> object:
    """A copy of checkpoint `source` at `target` whose config.json `edit(config)` changed in place."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_config_fields(hybrid_checkpoint):
    config = ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_5_vl"))
    assert config.architecture == "Qwen3_5ForConditionalGeneration" and config.hybrid.vision
    assert config.hybrid.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    linear = config.hybrid.linear
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.conv_dim) == (2, 4, 16, 128)
    assert config.rotary_dim == 8 and config.hybrid.mrope_section == (2, 1, 1)
    assert config.hybrid.mtp_num_hidden_layers == 1 and config.moe is None
    moe = ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_5_moe")).moe
    assert moe.norm_topk_prob and moe.shared_expert_intermediate_size == 48 and moe.is_sparse_layer(1)
    following = ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_next"))
    assert following.hybrid.linear.fused_projections and following.hybrid.mrope_section is None
    assert not following.is_sparse_layer(1) and following.is_sparse_layer(0)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                     "full_attention"]), "sliding_attention"),
    (lambda c: c.update(attn_output_gate=False), "attn_output_gate"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(layer_types=["linear_attention"] * 4), "full-attention"),
    (lambda c: c["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads"),
], ids=["layer-type", "ungated", "activation", "bias", "no-attention", "mrope", "gva"])
def test_unsupported_options_are_refused_by_name(hybrid_checkpoint, tmp_path, edit, named):
    checkpoint = edited_copy(hybrid_checkpoint("qwen3_5"), tmp_path / "edited", edit)
    with pytest.raises((ValueError, NotImplementedError), match=named):
        load_model(checkpoint, torch.float32, CPU, use_decode_kernel=False)


def test_quantizing_a_hybrid_moe_is_refused_naming_the_model(hybrid_checkpoint):
    with pytest.raises(NotImplementedError, match="Qwen3_5MoeForCausalLM: --quantization int8 runs dense models"):
        load_model(hybrid_checkpoint("qwen3_5_moe"), torch.float32, CPU, quantization="int8")


def test_a_missing_weight_is_named_in_the_checkpoint_spelling(hybrid_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoint = tmp_path / "broken"
    shutil.copytree(hybrid_checkpoint("qwen3_next"), checkpoint)
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["model.layers.1.linear_attn.in_proj_ba.weight"]
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.linear_attn\.in_proj_ba\.weight"):
        load_model(checkpoint, torch.float32, CPU, use_decode_kernel=False)


def test_mtp_weights_are_kept(hybrid_checkpoint):
    model, _ = load_model(hybrid_checkpoint("qwen3_5"), torch.float32, CPU, use_decode_kernel=False)
    names = {name for name, _ in model.mtp.named_buffers()}
    assert {"fc.weight", "norm.weight", "pre_fc_norm_embedding.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert model.mtp.num_layers == 1 and model.mtp.fc.weight.shape == (64, 128)


def test_mtp_layers_must_match_the_config(hybrid_checkpoint, tmp_path):
    checkpoint = edited_copy(hybrid_checkpoint("qwen3_5"), tmp_path / "edited",
                             lambda c: c.update(mtp_num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers is 2"):
        load_model(checkpoint, torch.float32, CPU, use_decode_kernel=False)


@torch.inference_mode()
def test_vision_language_checkpoint_runs_its_language_model(hybrid_checkpoint):
    checkpoint = hybrid_checkpoint("qwen3_5_vl")
    model, _ = load_model(checkpoint, torch.float32, CPU, use_decode_kernel=False)
    assert model.visual is not None  # the tower loads beside it (tests/model/test_vision_tower.py)
    tokens = hybrid_tokens(70, seed=7)
    hf = transformers_class("qwen3_5_vl").from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    want = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    pages = PagedSequences(16, 16)
    pages.add("a", tokens)
    caches = hybrid_caches(model, 16, 16, 2)
    got = []
    for decode, prefill in [([], [("a", 65)])] + [(["a"], [])] * 5:
        batch, _ = pages.batch(decode, prefill)
        got.append(model.compute_logits(model(with_state_slots(batch, decode, prefill, {"a": 1}), caches)))
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=FP32_ATOL)


def test_mrope_with_text_positions_is_partial_rope():
    """transformers' interleaved mRoPE, all three position streams the token's position, gives the cos/sin of
    plain RoPE over the rotary dims, whatever the sections."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    fields = {k: v for k, v in TINY_HYBRID_CONFIG.items() if k != "mtp_num_hidden_layers"}
    hf = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**fields))
    config = ModelConfig.from_dicts(dict(fields, model_type="qwen3_5_text"))
    positions = torch.arange(300)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, signed_sin = RotaryEmbedding(config)(positions, torch.float32)
    half = config.rotary_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(signed_sin[:, 0, half:], hf_sin[0, :, half:], rtol=0, atol=0)


def test_cache_specs_and_memory_per_sequence(hybrid_checkpoint):
    """A sequence keeps, per linear layer, its conv window in the model's dtype and an fp32 state per value head;
    K/V pages only for the attention layer."""
    model, _ = load_model(hybrid_checkpoint("qwen3_5"), torch.bfloat16, CPU, use_decode_kernel=False)
    specs = model.cache_specs()
    assert specs[:3] == [RecurrentStateSpec((128, 3), (4, 16, 16))] * 3 and specs[3] == PagedKVSpec(2, 32)
    per_layer = 128 * 3 * 2 + 4 * 16 * 16 * 4  # conv window bf16 + recurrent fp32
    assert StateCache.bytes_per_slot(specs, torch.bfloat16) == 3 * per_layer
