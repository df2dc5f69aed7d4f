"""Checkpoint loading: single file and shards, fused weights, dtype choices, clear errors for broken
checkpoints, config reading, the embedded default model and hub ids without a network."""

from __future__ import annotations

import json
import shutil
import socket
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from mili_openai.model import (
    TINY_SHAPE,
    CheckpointError,
    ModelConfig,
    build_random_checkpoint,
    default_model_path,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from mili_openai.model.default_model import DEFAULT_MODEL_SHAPE, HubUnreachableError
from mili_openai.model.loader import SINGLE_FILE

CPU = torch.device("cpu")


def copy_checkpoint(source, target):
    shutil.copytree(source, target)
    return target


def rewrite_weights(path, edit) -> None:
    tensors = load_file(str(path / SINGLE_FILE))
    edit(tensors)
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_checkpoint):
    sharded = build_random_checkpoint(tmp_path / "sharded", TINY_SHAPE, seed=0, num_shards=3)
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    assert not (sharded / SINGLE_FILE).exists()
    single, _ = load_model(tiny_checkpoint, torch.float32, CPU)
    shards, _ = load_model(sharded, torch.float32, CPU)
    want = single.state_dict()
    got = shards.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fused_projections_are_the_checkpoint_rows_in_order(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint, torch.float32, CPU)
    raw = load_file(str(tiny_checkpoint / SINGLE_FILE))
    prefix = "model.layers.1"
    qkv = model.get_submodule(f"{prefix}.self_attn.qkv_proj").weight
    parts = [raw[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv, torch.cat(parts))
    gate_up = model.get_submodule(f"{prefix}.mlp.gate_up_proj").weight
    assert torch.equal(gate_up, torch.cat([raw[f"{prefix}.mlp.gate_proj.weight"], raw[f"{prefix}.mlp.up_proj.weight"]]))
    assert torch.equal(model.get_submodule(f"{prefix}.self_attn.k_norm").weight,
                       raw[f"{prefix}.self_attn.k_norm.weight"])


def test_tied_and_untied_lm_heads(tiny_checkpoint, tiny_checkpoint_mha_untied):
    tied, _ = load_model(tiny_checkpoint, torch.float32, CPU)
    assert tied.lm_head is None
    hidden = torch.randn(3, TINY_SHAPE.hidden_size)
    torch.testing.assert_close(tied.compute_logits(hidden), hidden @ tied.model.embed_tokens.weight.T)
    untied, _ = load_model(tiny_checkpoint_mha_untied, torch.float32, CPU)
    raw = load_file(str(tiny_checkpoint_mha_untied / SINGLE_FILE))
    assert torch.equal(untied.lm_head.weight, raw["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_missing_weight_is_a_clear_error(tmp_path, tiny_checkpoint):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "missing")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing weights: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, torch.float32, CPU)


def test_unexpected_weight_is_a_clear_error(tmp_path, tiny_checkpoint):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "unexpected")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(path, torch.float32, CPU)


def test_wrong_shape_is_a_clear_error(tmp_path, tiny_checkpoint):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "shape")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        load_model(path, torch.float32, CPU)


def test_missing_shard_and_missing_weights_files(tmp_path):
    sharded = build_random_checkpoint(tmp_path / "sharded", TINY_SHAPE, seed=0, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(sharded, torch.float32, CPU)
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_model(sharded, torch.float32, CPU)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, torch.float32, CPU)


@pytest.mark.parametrize(
    "name,dtype",
    [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)],
)
def test_resolve_dtype(name, dtype):
    assert resolve_dtype(name) is dtype


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_in_reduced_precision(tiny_checkpoint, dtype):
    model, _ = load_model(tiny_checkpoint, dtype, CPU, use_decode_kernel=False)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # angles are never rounded to 16 bits
    assert not any(p.requires_grad for p in model.parameters())
    raw = load_file(str(tiny_checkpoint / SINGLE_FILE))
    assert torch.equal(model.model.norm.weight, raw["model.norm.weight"].to(dtype))


def test_model_to_keeps_rope_frequencies_in_float32(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, torch.float32, CPU)
    before = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)
    assert torch.equal(model.model.rotary_emb.inv_freq, before)


def test_config_reads_qwen3_fields(tiny_checkpoint):
    config = ModelConfig.from_pretrained(tiny_checkpoint)
    assert config.head_dim == 32 and config.hidden_size // config.num_attention_heads == 16
    assert config.eos_token_ids == (151645, 151643)  # generation_config.json's list wins
    assert config.bos_token_id == 151643
    assert config.tie_word_embeddings and config.rope_theta == 1e6 and config.rope.rope_type == "default"
    assert config.vocab_size == 151936 and config.max_position_embeddings == 40960


def test_config_falls_back_to_config_json_eos(tmp_path, tiny_checkpoint):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "no-generation-config")
    (path / "generation_config.json").unlink()
    assert ModelConfig.from_pretrained(path).eos_token_ids == (151645,)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"model_type": "llama"}, ValueError, "model_type"),
        ({"attention_bias": True}, NotImplementedError, "attention_bias"),
        ({"hidden_act": "gelu"}, NotImplementedError, "gelu"),
        ({"num_key_value_heads": 3}, ValueError, "multiple"),
        ({"head_dim": 31}, ValueError, "even"),
    ],
)
def test_config_rejects_what_it_cannot_run(tiny_checkpoint, change, error, match):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    with pytest.raises(error, match=match):
        ModelConfig.from_dicts({**config, **change})


def test_default_model_is_built_once_and_loads(tmp_path):
    path = resolve_model_path(None, str(tmp_path))
    assert path.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging dir left behind
    mtime = (path / SINGLE_FILE).stat().st_mtime_ns
    assert default_model_path(str(tmp_path)) == path
    assert (path / SINGLE_FILE).stat().st_mtime_ns == mtime  # reused, not rebuilt
    config = ModelConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (
        DEFAULT_MODEL_SHAPE.hidden_size, DEFAULT_MODEL_SHAPE.num_hidden_layers, DEFAULT_MODEL_SHAPE.head_dim)
    assert (path / "tokenizer.json").is_file() and "chat_template" in (path / "tokenizer_config.json").read_text()
    model, _ = load_model(path, torch.bfloat16, CPU)
    assert model.model.embed_tokens.weight.shape == (151936, 256)


def test_default_model_is_deterministic_and_safe_to_build_concurrently(tmp_path):
    paths, errors = [], []

    def build(cache):
        try:
            paths.append(default_model_path(cache))
        except Exception as exc:  # surfaced below; a thread cannot raise into the test
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(str(tmp_path / "shared"),)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "shared").iterdir()] == [paths[0].name]
    other = default_model_path(str(tmp_path / "other"))
    assert (paths[0] / SINGLE_FILE).read_bytes() == (other / SINGLE_FILE).read_bytes()


def test_local_directory_is_used_as_is(tiny_checkpoint):
    assert resolve_model_path(str(tiny_checkpoint), None) == tiny_checkpoint


def test_a_file_is_not_a_model(tiny_checkpoint):
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(tiny_checkpoint / "config.json"), None)


def test_unreachable_hub_fails_fast_with_advice(tmp_path, monkeypatch):
    """The hub is a local port that refuses connections (no network), its cache an empty folder: set on
    huggingface_hub's constants, which it reads from the environment once, at import."""
    import huggingface_hub.constants as hub

    with socket.socket() as refusing:  # bound but not listening: a connection is refused at once
        refusing.bind(("127.0.0.1", 0))
        monkeypatch.setattr(hub, "ENDPOINT", f"http://127.0.0.1:{refusing.getsockname()[1]}")
        monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        with pytest.raises(HubUnreachableError, match="could not be reached.*pass its local directory instead"):
            resolve_model_path("mili-openai-tests/no-such-model", None)


def test_invalid_hub_id_is_a_value_error():
    with pytest.raises(ValueError, match="neither a local directory nor a valid hub id"):
        resolve_model_path("not a/valid//hub id", None)
