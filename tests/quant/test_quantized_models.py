"""Quantized models end to end, against HF transformers on the dequantized weights: `--quantization` int8 and
int4, and AWQ, GPTQ and FP8 checkpoints written in their layouts by the tests. float32 activations run the
torch reference (greedy tokens identical to the oracle's); bf16 runs the compiled kernels, held to the
modules bit for bit (the decode stack) and to the oracle as closely as transformers' own bf16."""

from __future__ import annotations

import openai
import pytest
import torch

from engine_helpers import assert_matches, greedy, load_hf, random_prompts
from helpers_server import served_engine
from quant_helpers import (
    CPU,
    MAX_NEW,
    QUANT_SHAPE,
    QUANT_VOCAB,
    SERVED_SHAPE,
    UNTIED_SHAPE,
    assert_as_close_as_transformers_bf16,
    compressed_config,
    decode_schedule,
    oracle_tokens,
    run_steps,
    write_dequantized,
    write_quantized,
)

from mili_openai import LLM
from mili_openai.engine.memory_budget import weight_bytes
from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels
from mili_openai.model import CheckpointError, build_random_checkpoint, load_model
from mili_openai.model.quantization.apply import quantize_model
from mili_openai.model.quantization.modules import Fp8Linear, QuantizedEmbedding, QuantizedLinear

GPTQ_CONFIG = {"quant_method": "gptq", "desc_act": False, "sym": True, "static_groups": False}
FORMATS = {
    "awq": dict(group=64, config={"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                  "zero_point": True}),
    "gptq-int4": dict(bits=4, group=128, symmetric=True, stored_zero_offset=1,
                      config={**GPTQ_CONFIG, "bits": 4, "group_size": 128}),
    "gptq-int8": dict(bits=8, group=None, symmetric=True, stored_zero_offset=1,
                      config={**GPTQ_CONFIG, "bits": 8, "group_size": -1}),
    "gptq-v2-int4-asym": dict(bits=4, group=32, symmetric=False, stored_zero_offset=0,
                              config={**GPTQ_CONFIG, "bits": 4, "group_size": 32, "sym": False,
                                      "checkpoint_format": "gptq_v2"}),
    "fp8": dict(block=(128, 128), config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}),
}


@pytest.fixture(scope="module", params=["tied", "untied"])
def dense(request, tmp_path_factory):
    shape = QUANT_SHAPE if request.param == "tied" else UNTIED_SHAPE
    return build_random_checkpoint(tmp_path_factory.mktemp(f"dense-{request.param}"), shape, seed=3,
                                   dtype=torch.bfloat16)


@pytest.mark.parametrize("method, lm_head", [("int8", None), ("int4", None), ("int4", "int4"), ("int8", "int4")])
def test_quantized_at_load_matches_transformers_on_the_dequantized_weights(dense, method, lm_head, tmp_path):
    model, _ = load_model(dense, torch.float32, CPU, quantization=method, group_size=64,
                          lm_head_quantization=lm_head)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers + 1  # and the LM head
    assert model.lm_head.bits == (4 if lm_head == "int4" else 8)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) == model.config.tie_word_embeddings
    prompts, expected = oracle_tokens(write_dequantized(model, dense, tmp_path / "dequantized"))
    llm = LLM(str(dense), dtype="float32", num_pages=128, quantization=method, quantization_group_size=64,
              quantize_lm_head=lm_head)
    assert llm.core.info.quantization.startswith(method)
    assert f"LM head {lm_head or 'int8'}" in llm.core.info.quantization
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)
    llm.core.check_integrity()


@pytest.mark.parametrize("name", list(FORMATS))
def test_prequantized_checkpoints_load_as_their_formats_say(dense, name, tmp_path):
    options = FORMATS[name]
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(dense, quantized, reference, name.split("-")[0], **options)
    prompts, expected = oracle_tokens(reference)
    llm = LLM(str(quantized), dtype="float32", num_pages=128)
    assert llm.core.info.quantization.startswith(name.split("-")[0])
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)


def test_refused_checkpoints_fail_at_start_with_the_reason(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=4)
    act_order = dict(FORMATS["gptq-int4"])
    act_order["config"] = {**act_order["config"], "desc_act": True}
    write_quantized(dense, tmp_path / "act-order", tmp_path / "ref1", "gptq", **act_order)
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(tmp_path / "act-order"), dtype="float32", num_pages=16)
    write_quantized(dense, tmp_path / "awq", tmp_path / "ref2", "awq", **FORMATS["awq"])
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "awq"), dtype="float32", num_pages=16, quantization="int8")
    # a g_idx out of order is an act-order checkpoint whatever its config says
    from safetensors.torch import load_file, save_file

    write_quantized(dense, tmp_path / "shuffled", tmp_path / "ref3", "gptq", **FORMATS["gptq-int4"])
    tensors = load_file(str(tmp_path / "shuffled" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "shuffled" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="g_idx"):
        load_model(tmp_path / "shuffled", torch.float32, CPU)


def test_quantized_weights_take_their_bits(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=5, dtype=torch.bfloat16)
    sizes = {method: weight_bytes(load_model(dense, torch.bfloat16, CPU, use_decode_kernel=False,
                                             quantization=method)[0]) for method in (None, "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < 0.6 * sizes[None]


# checkpoints the decode stack runs as written: (writer's method, its options)
PREQUANTIZED = {
    "awq": ("awq", FORMATS["awq"]),
    "w4a16-channel": ("compressed-tensors", dict(bits=4, group=None, symmetric=False, config=compressed_config(
        "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"}))),
    "w8a16": ("compressed-tensors", dict(bits=8, group=None, symmetric=True, config=compressed_config(
        "pack-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}))),
}
needs_kernels = pytest.mark.skipif(
    not (cpu_supports_kernels() and load_cpu_kernels() is not None and load_cpu_kernels().bf16_dot_products),
    reason="the quantized kernels need AVX512-BF16")


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4", "int4-lm-head-int4", "awq", "w4a16-channel", "w8a16"])
def test_decode_stack_runs_quantized_weights_as_the_modules_do(method, tmp_path):
    """Decode-only steps through the compiled stack: logits and K/V exactly those of the same kernels called
    module by module (the embedding rows too: an int4 LM head's, tied, dequantized by the stack)."""
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=6, dtype=torch.bfloat16)
    path = dense
    if method in PREQUANTIZED:
        path = tmp_path / method
        writer, options = PREQUANTIZED[method]
        write_quantized(dense, path, tmp_path / "reference", writer, **options)
    scheme, _, lm_head = method.partition("-lm-head-")
    model, config = load_model(path, torch.bfloat16, CPU, quantization=None if method in PREQUANTIZED else scheme,
                               lm_head_quantization=lm_head or None)
    stack = model.model.decode_stack
    assert stack is not None
    tokens, steps = decode_schedule()
    with_stack = run_steps(model, config, tokens, steps, seed=1)
    model.model.decode_stack = None
    with_modules = run_steps(model, config, tokens, steps, seed=1)
    model.model.decode_stack = stack
    for (key, position, got), (_, _, want) in zip(with_stack[0], with_modules[0]):
        assert torch.equal(got, want), f"{key} position {position}"
    assert torch.equal(with_stack[1], with_modules[1])


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_bf16_kernels_as_close_to_the_oracle_as_transformers_bf16(method, tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=7, dtype=torch.bfloat16)
    model, config = load_model(dense, torch.bfloat16, CPU, quantization=method)
    assert model.model.decode_stack is not None
    reference = write_dequantized(model, dense, tmp_path / "dequantized")
    hf32, hf16 = load_hf(reference), load_hf(reference, torch.bfloat16)
    assert_as_close_as_transformers_bf16(model, config, hf32, hf16)


def test_models_endpoint_states_the_quantization(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", SERVED_SHAPE, seed=8)
    with served_engine(dense, num_pages=32, quantization="int4") as (live, _):
        models = openai.OpenAI(base_url=live.api_base, api_key="x").models.list()
        assert models.data[0].model_extra["quantization"].startswith("int4 (groups of 128")


def test_int4_lm_head_served_as_offline(tmp_path):
    """`--quantize-lm-head int4` through the server: /v1/models says so, and greedy completions are the offline
    engine's (whose tokens the test above holds to transformers on the dequantized weights)."""
    dense = build_random_checkpoint(tmp_path / "dense", SERVED_SHAPE, seed=9)
    options = dict(num_pages=64, quantization="int4", quantization_group_size=64, quantize_lm_head="int4")
    prompts = random_prompts(2, [5, 33], seed=12, vocab=QUANT_VOCAB)
    llm = LLM(str(dense), dtype="float32", **options)
    offline = [output.outputs[0].text for output in llm.generate(prompts, greedy(MAX_NEW))]
    del llm
    with served_engine(dense, **options) as (live, _):
        client = openai.OpenAI(base_url=live.api_base, api_key="x", max_retries=0)
        assert "LM head int4 (groups of 64" in client.models.list().data[0].model_extra["quantization"]
        served = [client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for prompt in prompts]
    assert served == offline


@torch.inference_mode()
def test_fp8_model_on_cpu_gives_transformers_logits_on_the_dequantized_weights(dense, tmp_path):
    """fp8 projections (`--quantization fp8` needs CUDA to serve; here quantize_model on a float32 model)
    through their torch paths, weight-only for float32: every row's logits are transformers' on the
    dequantized weights, through prefill chunks and decode steps (tests/quant/test_quantized_cuda.py holds the
    Triton kernels to the same oracle on the GPU)."""
    model, config = load_model(dense, torch.float32, CPU)
    quantize_model(model, "fp8", group_size=128)
    layers = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    assert len(layers) == 4 * config.num_hidden_layers and layers[0].fp8.per_row
    hf = load_hf(write_dequantized(model, dense, tmp_path / "dequantized"))
    tokens, steps = decode_schedule()
    rows, _ = run_steps(model, config, tokens, steps, seed=4)
    for key, position, logits in rows:
        want = hf(torch.tensor([tokens[key][:position + 1]])).logits[0, -1]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
