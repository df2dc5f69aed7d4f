"""RoPE variants against transformers: cos/sin for every supported type and spelling, and end-to-end
logits on checkpoints whose positions run past the pretraining context the scaling is about."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mili_openai.model import ForwardBatch, KVCache, ModelCaches, ModelConfig, PrefillSegment, load_model
from mili_openai.model.batch import PageTables
from mili_openai.model.checkpoint import TINY_SHAPE, build_random_checkpoint, config_dict
from mili_openai.model.rope import RotaryEmbedding, RotaryTable

SMALL_CONTEXT = 32  # original_max_position_embeddings: positions below 128 go well past it
POSITIONS = 128
FP32_ATOL = 1e-4
ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SMALL_CONTEXT},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": SMALL_CONTEXT,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": SMALL_CONTEXT},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": SMALL_CONTEXT},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
ROPE_THETA = 10000.0  # with head_dim 32: wavelengths from 6 to ~35k, so every llama3/yarn band is hit


def shape_for(rope_scaling) -> object:
    return dataclasses.replace(TINY_SHAPE, vocab_size=1024, num_hidden_layers=1, rope_theta=ROPE_THETA,
                               rope_scaling=rope_scaling, max_position_embeddings=4 * SMALL_CONTEXT
                               if rope_scaling and rope_scaling["rope_type"] == "dynamic" else 40960)


def hf_cos_sin(config_json: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = Qwen3RotaryEmbedding(Qwen3Config(**config_json))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])  # (1, T, D)
    return cos[0], sin[0]


def our_cos_sin(config_json: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, signed_sin = RotaryEmbedding(ModelConfig.from_dicts(config_json))(positions, torch.float32)  # (T, 1, D)
    half = cos.shape[-1] // 2
    sin = torch.cat((-signed_sin[:, 0, :half], signed_sin[:, 0, half:]), dim=-1)  # transformers' [sin, sin]
    return cos[:, 0], sin


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_cos_sin_match_transformers(variant, spelling):
    shape = shape_for(ROPE_VARIANTS[variant])
    config_json = config_dict(shape, torch.float32)
    if spelling == "rope_parameters":  # transformers 5.x spelling: theta inside, no top-level keys
        params = dict(config_json.pop("rope_scaling") or {"rope_type": "default"})
        params["rope_theta"] = config_json.pop("rope_theta")
        config_json["rope_parameters"] = params
    limit = min(POSITIONS, shape.max_position_embeddings)
    positions = torch.arange(limit)
    want_cos, want_sin = hf_cos_sin(config_json, positions)
    got_cos, got_sin = our_cos_sin(config_json, positions)
    torch.testing.assert_close(got_cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_sin, want_sin, rtol=0, atol=1e-6)


def test_variants_really_differ():
    positions = torch.arange(POSITIONS)
    cos = {name: our_cos_sin(config_dict(shape_for(v), torch.float32), positions)[0]
           for name, v in ROPE_VARIANTS.items() if name != "dynamic"}
    names = list(cos)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(cos[a], cos[b], atol=1e-3), (a, b)


def test_dynamic_ntk_refuses_positions_past_the_pretraining_context():
    shape = shape_for(ROPE_VARIANTS["dynamic"])
    rotary = RotaryEmbedding(ModelConfig.from_dicts(config_dict(shape, torch.float32)))
    rotary(torch.arange(shape.max_position_embeddings), torch.float32)  # inside: fine
    with pytest.raises(NotImplementedError, match="dynamic NTK"):
        rotary(torch.tensor([3, shape.max_position_embeddings]), torch.float32)


def test_rotary_table_rows_equal_each_position_computed_alone():
    # Qwen3's head_dim: a row of 64 angles fills ATen's vector steps, so the table must match bit for bit
    shape = dataclasses.replace(shape_for(ROPE_VARIANTS["yarn"]), head_dim=128)
    rotary = RotaryEmbedding(ModelConfig.from_dicts(config_dict(shape, torch.float32)))
    table = RotaryTable(rotary, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for last in (3, 300, 1000, 5000):  # the table grows past its first block several times
        positions = torch.randint(0, last + 1, (9,), generator=generator)
        positions[0] = last
        cos, signed_sin = table(positions, last)
        for row, position in enumerate(positions.tolist()):
            want_cos, want_sin = rotary(torch.tensor([position]), torch.bfloat16)
            assert torch.equal(cos[row], want_cos[0]) and torch.equal(signed_sin[row], want_sin[0]), position


def test_rotary_table_stops_at_the_dynamic_ntk_limit():
    shape = shape_for(ROPE_VARIANTS["dynamic"])
    rotary = RotaryEmbedding(ModelConfig.from_dicts(config_dict(shape, torch.float32)))
    table = RotaryTable(rotary, torch.float32)
    inside = shape.max_position_embeddings - 1
    cos, _ = table(torch.tensor([inside]), inside)  # growing by doubling must not ask for rows past it
    assert torch.equal(cos, rotary(torch.tensor([inside]), torch.float32)[0])
    with pytest.raises(NotImplementedError, match="dynamic NTK"):
        table(torch.tensor([inside + 1]), inside + 1)


def test_unsupported_rope_type_is_a_clear_error():
    config_json = config_dict(shape_for({"rope_type": "longrope", "factor": 2.0}), torch.float32)
    with pytest.raises(NotImplementedError, match="longrope"):
        ModelConfig.from_dicts(config_json)


@pytest.mark.parametrize("variant", ["linear", "yarn", "llama3", "dynamic"])
@torch.inference_mode()
def test_logits_match_transformers(tmp_path, variant):
    from transformers import Qwen3ForCausalLM as HFQwen3

    shape = shape_for(ROPE_VARIANTS[variant])
    path = build_random_checkpoint(tmp_path / variant, shape, seed=5)
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    hf = HFQwen3.from_pretrained(str(path), dtype=torch.float32).eval()
    length = min(POSITIONS, shape.max_position_embeddings)
    tokens = torch.randint(0, shape.vocab_size, (length,), generator=torch.Generator().manual_seed(6))
    slots = torch.arange(length)
    pages = PageTables(16, decode=None, prefill=torch.arange(length // 16)[None, :],
                       prefill_cu_seqlens=torch.tensor([0, length]), prefill_ctx_lens=torch.tensor([length]),
                       max_prefill_len=length)
    batch = ForwardBatch(input_ids=tokens, positions=torch.arange(length), slot_mapping=slots, num_decode=0,
                         decode_ctx_lens=None, prefills=[PrefillSegment(0, length, length)],
                         logits_indices=torch.arange(length), pages=pages)
    cache = KVCache(model.cache_specs(), num_pages=length // 16, page_size=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    got = model.compute_logits(model(batch, ModelCaches(cache)))
    want = hf(tokens[None]).logits[0].float()
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
