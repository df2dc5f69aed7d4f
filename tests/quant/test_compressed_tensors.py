"""llm-compressor's compressed-tensors checkpoints: reading `quantization_config` (and refusing what is not
supported), greedy tokens identical to transformers fp32 on the dequantized weights for checkpoints written
in the layouts by hand, and the library's own compressors as the layout oracle."""

from __future__ import annotations

import copy

import openai
import pytest
import torch

from engine_helpers import assert_matches, greedy
from helpers_server import served_engine
from quant_helpers import (
    CPU,
    MAX_NEW,
    QUANT_SHAPE,
    SERVED_SHAPE,
    UNTIED_SHAPE,
    compressed_config,
    dequantized_weight,
    library_fused,
    oracle_tokens,
    read_weights,
    write_checkpoint,
    write_library_checkpoint,
    write_quantized,
)

from mili_openai import LLM
from mili_openai.model import CheckpointError, build_random_checkpoint, load_model
from mili_openai.model.quantization.compressed_tensors import CompressedTensorsScheme
from mili_openai.model.quantization.modules import QuantizedLinear
from mili_openai.model.quantization.spec import parse_quantization_config

FP8_DYNAMIC_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def int_weights(bits: int, group: int | None, symmetric: bool = True, **extra) -> dict:
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel", "group_size": None}
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "actorder": None, "observer": "minmax",
            **strategy, **extra}


def int_layout(fmt: str, bits: int, group: int | None, symmetric: bool = True, **options) -> dict:
    return dict(bits=bits, group=group, symmetric=symmetric,
                config=compressed_config(fmt, int_weights(bits, group, symmetric)), **options)


W4A16 = compressed_config("pack-quantized", int_weights(4, 128))
FP8_DYNAMIC = compressed_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                                    "strategy": "channel"}, FP8_DYNAMIC_ACTIVATIONS)
LAYOUTS = {
    "w4a16-group": int_layout("pack-quantized", 4, 64),
    "w4a16-asym-group": int_layout("pack-quantized", 4, 32, symmetric=False),
    "w4a16-channel": int_layout("pack-quantized", 4, None),
    "w4a16-asym-channel": int_layout("pack-quantized", 4, None, symmetric=False),
    "w8a16-channel": int_layout("pack-quantized", 8, None),
    "w8a16-int-quantized": int_layout("int-quantized", 8, None),
    "w4a16-down-ignored": dict(int_layout("pack-quantized", 4, 128), dense=("mlp.down_proj",)),
    "fp8-dynamic": dict(config=FP8_DYNAMIC),
}
LAYOUTS["w4a16-down-ignored"]["config"]["ignore"] = ["lm_head", r"re:.*mlp\.down_proj$"]


@pytest.fixture(scope="module", params=["tied", "untied"])
def dense(request, tmp_path_factory):
    shape = QUANT_SHAPE if request.param == "tied" else UNTIED_SHAPE
    return build_random_checkpoint(tmp_path_factory.mktemp(f"dense-{request.param}"), shape, seed=13,
                                   dtype=torch.bfloat16)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoints_give_transformers_greedy_tokens_on_the_dequantized_weights(dense, name, tmp_path):
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(dense, quantized, reference, "compressed-tensors", **LAYOUTS[name])
    prompts, expected = oracle_tokens(reference)
    llm = LLM(str(quantized), dtype="float32", num_pages=128)
    assert llm.core.info.quantization.startswith("compressed-tensors (")
    if name.startswith("fp8"):  # on CPU, as fine-grained FP8 checkpoints: dequantized at load
        assert llm.core.info.quantization.endswith("dequantized to float32 at load")
    else:
        quantized_modules = [m for m in llm.core.runner.forward.model.modules() if isinstance(m, QuantizedLinear)]
        dense_down = "dense" in LAYOUTS[name]
        assert len(quantized_modules) == (3 if dense_down else 4) * QUANT_SHAPE.num_hidden_layers
        assert {m.bits for m in quantized_modules} == {LAYOUTS[name]["bits"]}
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)


@pytest.mark.parametrize("raw, want", [
    (W4A16, CompressedTensorsScheme("pack-quantized", "int", 4, "group", 128, targets=("Linear",),
                                    ignore=("lm_head",))),
    (compressed_config("pack-quantized", int_weights(4, None, symmetric=False, actorder="weight")),
     CompressedTensorsScheme("pack-quantized", "int", 4, "channel", symmetric=False, targets=("Linear",),
                             ignore=("lm_head",))),
    (compressed_config("naive-quantized", {"num_bits": 8, "group_size": -1}),  # strategy inferred from -1
     CompressedTensorsScheme("naive-quantized", "int", 8, "channel", targets=("Linear",), ignore=("lm_head",))),
    (FP8_DYNAMIC, CompressedTensorsScheme("float-quantized", "float", 8, "channel", targets=("Linear",),
                                          ignore=("lm_head",))),
    (compressed_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]},
                       {**FP8_DYNAMIC_ACTIVATIONS, "strategy": "group", "group_size": 128}),
     CompressedTensorsScheme("float-quantized", "float", 8, "block", block=(128, 128), targets=("Linear",),
                             ignore=("lm_head",))),
])
def test_supported_configs(raw, want):
    quant = parse_quantization_config(raw)
    assert (quant.method, quant.bits, quant.scheme) == ("compressed-tensors", want.bits, want)
    assert quant.describe().startswith("compressed-tensors (")


def test_scheme_matches_targets_and_ignore_as_compressed_tensors_does():
    scheme = parse_quantization_config(compressed_config(
        "pack-quantized", int_weights(4, 128), ignore=("lm_head", r"re:.*layers\.1\..*"))).scheme
    assert scheme.quantizes("model.layers.0.mlp.down_proj") and not scheme.quantizes("lm_head")
    assert not scheme.quantizes("model.layers.1.self_attn.q_proj")
    raw = copy.deepcopy(W4A16)
    raw["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*", "model.layers.0.mlp.up_proj"]
    raw["config_groups"]["group_1"] = raw["config_groups"]["group_0"] | {"targets": ["re:.*gate_proj"]}
    scheme = parse_quantization_config(raw).scheme
    assert scheme.quantizes("model.layers.1.self_attn.o_proj") and scheme.quantizes("model.layers.0.mlp.up_proj")
    assert scheme.quantizes("model.layers.1.mlp.gate_proj") and not scheme.quantizes("model.layers.1.mlp.up_proj")


def with_weights(base: dict, **changes) -> dict:
    raw = copy.deepcopy(base)
    raw["config_groups"]["group_0"]["weights"].update(changes)
    return raw


def with_group(base: dict, **changes) -> dict:
    raw = copy.deepcopy(base)
    raw["config_groups"]["group_0"].update(changes)
    return raw


INT8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
MIXED = copy.deepcopy(W4A16)
MIXED["config_groups"]["group_1"] = {"targets": ["re:.*mlp.*"], "weights": int_weights(8, None)}


@pytest.mark.parametrize("raw, message", [
    (with_group(W4A16, input_activations=INT8_ACTIVATIONS), "W4A8"),  # W8A8: test_compressed_tensors_w8a8.py
    (with_group(FP8_DYNAMIC, input_activations={**FP8_DYNAMIC_ACTIVATIONS, "dynamic": False, "strategy": "tensor"}),
     "static activation scales"),
    (with_group(FP8_DYNAMIC, input_activations=None), "without activation quantization"),
    (W4A16 | {"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}}, "2:4"),
    (W4A16 | {"format": "marlin-24"}, "marlin-24"),
    (W4A16 | {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "kv_cache_scheme"),
    (W4A16 | {"transform_config": {"config_groups": {}}}, "transform_config"),
    (with_weights(W4A16, actorder="group"), "actorder 'group'"),
    (with_weights(W4A16, actorder=True), "actorder True"),
    (with_weights(W4A16, num_bits=3), "3 bits"),
    (with_weights(W4A16, num_bits=8, symmetric=False, strategy="channel", group_size=None), "8-bit int weights with"),
    (with_weights(W4A16, strategy="tensor", group_size=None), "strategy 'tensor'"),
    (with_weights(W4A16, strategy="group", group_size=None), "positive group_size"),
    (with_weights(W4A16, dynamic=True), "dynamically"),
    (with_weights(FP8_DYNAMIC, num_bits=4), "float weights of 4 bits"),
    (with_weights(W4A16, type="float"), "format 'pack-quantized' for float weights"),
    (MIXED, "mixed schemes"),
    (W4A16 | {"config_groups": {"W4A16": ["Linear"]}}, "preset names"),
    (with_group(W4A16, targets=["Qwen3MLP"]), "module classes other than Linear"),
    (W4A16 | {"ignore": ["re:(unclosed"]}, "not a valid regex"),
    (with_group(W4A16, weights=None), "quantizes no weights"),
    (W4A16 | {"config_groups": {}}, "needs config_groups"),
])
def test_unsupported_configs_are_refused_with_what_is_supported(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


def test_refused_at_start_and_stored_modules_must_agree_with_the_config(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=14)
    act_order = int_layout("pack-quantized", 4, 128)
    act_order["config"] = with_weights(act_order["config"], actorder="group")
    write_quantized(dense, tmp_path / "act-order", tmp_path / "ref1", "compressed-tensors", **act_order)
    with pytest.raises(ValueError, match="actorder"):
        LLM(str(tmp_path / "act-order"), dtype="float32", num_pages=16)
    write_quantized(dense, tmp_path / "w4a16", tmp_path / "ref2", "compressed-tensors",
                    **int_layout("pack-quantized", 4, 128))
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "w4a16"), dtype="float32", num_pages=16, quantization="int4")
    # down_proj stored dense while the config quantizes every Linear but lm_head
    write_quantized(dense, tmp_path / "stray", tmp_path / "ref3", "compressed-tensors",
                    **int_layout("pack-quantized", 4, 128, dense=("mlp.down_proj",)))
    with pytest.raises(CheckpointError, match="down_proj: config.json's quantization_config quantizes it"):
        load_model(tmp_path / "stray", torch.float32, CPU)
    # stored quantized where the config's ignore leaves it dense
    write_quantized(dense, tmp_path / "ignored", tmp_path / "ref4", "compressed-tensors",
                    **int_layout("pack-quantized", 4, 128))
    config = (tmp_path / "ignored" / "config.json")
    config.write_text(config.read_text().replace('"lm_head"', r'"lm_head", "re:.*o_proj"'))
    with pytest.raises(CheckpointError, match="o_proj: .* leaves it unquantized"):
        load_model(tmp_path / "ignored", torch.float32, CPU)


def test_models_endpoint_states_the_scheme(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", SERVED_SHAPE, seed=15)
    write_quantized(dense, tmp_path / "w4a16", tmp_path / "ref", "compressed-tensors",
                    **int_layout("pack-quantized", 4, 64, symmetric=False))
    want = "compressed-tensors (4-bit, groups of 64, zero points; pack-quantized)"
    with served_engine(tmp_path / "w4a16", num_pages=32) as (live, _):
        models = openai.OpenAI(base_url=live.api_base, api_key="x").models.list()
        assert models.data[0].model_extra["quantization"] == want


# --- compressed-tensors' own compressors as the layout oracle ---------------------------------------------

LIBRARY_SCHEMES = {
    "w4a16-group": ("pack-quantized", int_weights(4, 64), None),
    "w4a16-asym-group": ("pack-quantized", int_weights(4, 32, symmetric=False), None),
    "w4a16-asym-channel": ("pack-quantized", int_weights(4, None, symmetric=False), None),
    "w8a16-channel": ("pack-quantized", int_weights(8, None), None),
    "w8a16-group-naive": ("naive-quantized", int_weights(8, 128), None),
    "fp8-dynamic": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                    FP8_DYNAMIC_ACTIVATIONS),
}


@pytest.mark.parametrize("name", list(LIBRARY_SCHEMES))
def test_library_compressed_checkpoint_reads_back_the_librarys_weights(name, tmp_path):
    """A tiny checkpoint whose projections compressed-tensors itself compressed: every projection mili builds
    (fused, packed into its layout) dequantizes to exactly what the library decompresses, and greedy tokens
    are transformers' on those weights."""
    pytest.importorskip("compressed_tensors")
    fmt, weights, activations = LIBRARY_SCHEMES[name]
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=16, dtype=torch.bfloat16)
    quantized, plain, library = write_library_checkpoint(dense, tmp_path / "quantized", fmt, weights, activations)
    model, config = load_model(quantized, torch.float32, CPU)
    for layer in range(config.num_hidden_layers):
        block = model.model.layers[layer]
        for module_name, want in library_fused(library, layer).items():
            got = (dequantized_weight(block.get_submodule(module_name)) if not name.startswith("fp8")
                   else block.get_submodule(module_name).weight)  # fp8 on CPU: dense, dequantized at load
            assert torch.equal(got, want), f"layer {layer} {module_name}"
    reference = write_checkpoint(dense, tmp_path / "reference", plain, None)
    prompts, expected = oracle_tokens(reference)
    assert_matches(LLM(str(quantized), dtype="float32", num_pages=128).generate(prompts, greedy(MAX_NEW)), expected)


def test_int4_scales_float16_cannot_hold_are_rounded_and_said(tmp_path, caplog):
    """The int4 layout keeps float16 scales: bf16 ones from 2^-17 up convert exactly (the other tests), a
    float32 one with more significant bits is rounded, and the log and the description say how many."""
    from safetensors.torch import save_file

    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=17)
    path = tmp_path / "w4a16"
    write_quantized(dense, path, tmp_path / "ref", "compressed-tensors", **int_layout("pack-quantized", 4, 128))
    tensors = read_weights(path)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name].float() * (1 + 2 ** -20)
    save_file(tensors, str(path / "model.safetensors"))
    with caplog.at_level("WARNING"):
        model, _ = load_model(path, torch.float32, CPU)
    rounded = tensors[name].numel()
    assert model.quantization.endswith(f"; {rounded} scales rounded to float16")
    assert f"{rounded} int4 scales were rounded to float16" in caplog.text
