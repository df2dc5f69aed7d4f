"""compressed-tensors W8A8 int8 checkpoints (int8 weights, int8 activations, e.g. RedHatAI/Qwen3-*-quantized.w8a8).

The oracle: transformers fp32 on the dequantized weights with each quantized Linear's input fake-quantized as
vLLM's int8 GEMM quantizes it (a forward pre-hook: x -> q * s, per token dynamic or with the static scale, a
fused projection's largest), written here from that description. In fp32 greedy tokens must be identical and
logprobs within W8A8_LOGPROB_ATOL, and most within engine_helpers' LOGPROB_ATOL: rounding to int8 is
discontinuous, so a value within a last-bit difference of a half step (x summed in another order) rounds the
other way in one of the two, moving that activation by a whole step, and through K/V the later positions
too. Where the oracle's best two tokens are that close, the other may win; the sequences part there
(`assert_greedy_up_to_near_ties`). The logits test shows the rest of the rows equal within ROW_ATOL. The
bf16 compiled kernels must be as close to the fp32 oracle as transformers' own bf16 with the same hook is,
within quant_helpers' BF16_ERROR_RATIO.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from engine_helpers import LOGPROB_ATOL, greedy, hf_greedy, load_hf, random_prompts
from quant_helpers import (
    CPU,
    MAX_NEW,
    QUANT_SHAPE,
    QUANT_VOCAB,
    UNTIED_SHAPE,
    assert_as_close_as_transformers_bf16,
    compressed_config,
    decode_schedule,
    dequantized_weight,
    library_fused,
    read_weights,
    run_steps,
    write_checkpoint,
    write_library_checkpoint,
    write_quantized,
)

from mili_openai import LLM
from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels
from mili_openai.kernels.quantized import PackedWeights, quantize_int8_rows, reference_linear
from mili_openai.model import CheckpointError, build_random_checkpoint, load_model
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.quantization.activations import Int8Activations
from mili_openai.model.quantization.modules import QuantizedLinear
from mili_openai.model.quantization.spec import parse_quantization_config

DYNAMIC = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
STATIC = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
GROUPS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
W8A8 = compressed_config("int-quantized", CHANNEL, DYNAMIC)
# static scales as fractions of each input's calibrated range: q, k, v (and gate, up) differ, so the fused
# projection's largest one decides; those under 1 clamp the largest tokens at -128 / 127
STATIC_FRACTIONS = {"q_proj": 0.5, "k_proj": 0.75, "v_proj": 1.0, "o_proj": 0.5, "gate_proj": 0.6, "up_proj": 0.9,
                    "down_proj": 0.7}
FUSED_PARTS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
PROMPT_LENGTHS = [1, 9, 40, 130]
W8A8_LOGPROB_ATOL = 0.1  # a half-step tie rounded the other way moves these tiny models' logprobs by < 0.05
ROW_ATOL = 1e-4  # float32 logits where no activation rounded differently
needs_kernels = pytest.mark.skipif(
    not (cpu_supports_kernels() and load_cpu_kernels() is not None and load_cpu_kernels().bf16_dot_products),
    reason="the quantized kernels need AVX512-BF16")


def fake_quantize(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x as vLLM's int8 GEMM sees it: per token, the int8 levels times their scale, in x's dtype."""
    values = x.float()
    if scale is None:
        amax = values.abs().amax(dim=-1, keepdim=True)
        levels, step = torch.round(values * torch.nan_to_num(127 / amax, posinf=0.0)), amax / 127
    else:
        levels, step = torch.round(values / scale), torch.tensor(scale)
    return (levels.clamp(-128, 127) * step).to(x.dtype)


def fused_scale(scales: dict[str, float], name: str) -> float:
    """The static scale vLLM quantizes module `name`'s input with: the largest of its fused projection's parts."""
    prefix, _, projection = name.rpartition(".")
    group = next((parts for parts in FUSED_PARTS.values() if projection in parts), (projection,))
    return max(scales[f"{prefix}.{part}"] for part in group)


def hooked_hf(reference, scales: dict[str, float] | None, dtype=torch.float32):
    """transformers on `reference` with every decoder projection's input fake-quantized (static: `scales`)."""
    hf = load_hf(reference, dtype)
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            scale = None if scales is None else fused_scale(scales, name)
            module.register_forward_pre_hook(lambda _, args, scale=scale: (fake_quantize(args[0], scale),))
    return hf


@torch.inference_mode()
def calibrated_scales(reference, prompts) -> dict[str, float]:
    """Static input scales as a calibration would pick them from `prompts` (max|x| / 127 of each projection's
    input), times STATIC_FRACTIONS, rounded to bf16 as the checkpoint stores them."""
    hf, ranges, hooks = load_hf(reference), {}, []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            def record(_, args, name=name):
                ranges[name] = max(ranges.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(record))
    for prompt in prompts:
        hf(torch.tensor([prompt]))
    return {name: float(torch.tensor(amax / 127 * STATIC_FRACTIONS[name.rpartition(".")[2]]).bfloat16())
            for name, amax in ranges.items()}


def add_input_scales(path, scales: dict[str, float]) -> None:
    tensors = read_weights(path)
    tensors.update({f"{name}.input_scale": torch.tensor([scale], dtype=torch.bfloat16)
                    for name, scale in scales.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def write_w8a8(dense, tmp_path, weights: dict, activations: dict) -> tuple:
    """A W8A8 checkpoint of `dense` -> (its path, its dequantized reference's path, the static scales or None)."""
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(dense, quantized, reference, "compressed-tensors", bits=8, group=weights["group_size"],
                    symmetric=True, config=compressed_config("int-quantized", weights, activations))
    scales = None
    if not activations["dynamic"]:
        scales = calibrated_scales(reference, random_prompts(3, [20, 70], seed=5, vocab=QUANT_VOCAB))
        add_input_scales(quantized, scales)
    return quantized, reference, scales


def assert_greedy_up_to_near_ties(outputs, expected) -> None:
    """Greedy tokens the oracle's, each step's logprobs (ours and the top ones) within W8A8_LOGPROB_ATOL of its
    row and most within LOGPROB_ATOL, up to a step where we picked a token the oracle puts within
    W8A8_LOGPROB_ATOL of its best (a near tie a rounding decided): the continuations part there."""
    steps = close = 0
    for output, (tokens, rows) in zip(outputs, expected):
        completion = output.outputs[0]
        assert len(completion.token_ids) == len(tokens)
        for token, want, got, row in zip(completion.token_ids, tokens, completion.logprobs, rows):
            errors = [abs(got.logprob - float(row[token]))] + [abs(lp - float(row[i])) for i, lp in got.top]
            assert max(errors) <= W8A8_LOGPROB_ATOL
            steps, close = steps + 1, close + (max(errors) <= LOGPROB_ATOL)
            if token != want:
                assert float(row[want] - row[token]) <= W8A8_LOGPROB_ATOL, "not a near tie"
                break
    assert close * 2 >= steps, f"only {close} of {steps} steps within {LOGPROB_ATOL}"


@pytest.fixture(scope="module", params=["tied", "untied"])
def dense(request, tmp_path_factory):
    shape = QUANT_SHAPE if request.param == "tied" else UNTIED_SHAPE
    return build_random_checkpoint(tmp_path_factory.mktemp(f"dense-{request.param}"), shape, seed=23,
                                   dtype=torch.bfloat16)


SCHEMES = {"dynamic": (CHANNEL, DYNAMIC), "static": (CHANNEL, STATIC), "dynamic-groups": (GROUPS, DYNAMIC)}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_w8a8_gives_the_hooked_oracles_greedy_tokens(dense, name, tmp_path):
    weights, activations = SCHEMES[name]
    quantized, reference, scales = write_w8a8(dense, tmp_path, weights, activations)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11, vocab=QUANT_VOCAB)
    hf = hooked_hf(reference, scales)
    expected = [hf_greedy(hf, prompt, MAX_NEW) for prompt in prompts]
    llm = LLM(str(quantized), dtype="float32", num_pages=128)
    per = "per token, dynamic" if activations["dynamic"] else "per tensor, static"
    assert llm.core.info.quantization.endswith(f"; int-quantized; int8 activations {per})")
    modules = [m for m in llm.core.runner.forward.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(modules) == 4 * QUANT_SHAPE.num_hidden_layers and all(m.activations is not None for m in modules)
    assert_greedy_up_to_near_ties(llm.generate(prompts, greedy(MAX_NEW)), expected)
    llm.core.check_integrity()


def test_static_scales_of_fused_parts_take_the_largest(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=24, dtype=torch.bfloat16)
    quantized, _, scales = write_w8a8(dense, tmp_path, CHANNEL, STATIC)
    model, _ = load_model(quantized, torch.float32, CPU)
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        for module, part in ((layer.self_attn.qkv_proj, "self_attn.v_proj"), (layer.self_attn.o_proj,
                             "self_attn.o_proj"), (layer.mlp.gate_up_proj, "mlp.up_proj"),
                             (layer.mlp.down_proj, "mlp.down_proj")):
            want = fused_scale(scales, f"{prefix}.{part}")
            assert float(module.activations.static_scale) == want, f"{prefix} {part}"
    assert fused_scale(scales, "model.layers.0.self_attn.q_proj") > scales["model.layers.0.self_attn.q_proj"]


@torch.inference_mode()
def test_activations_are_quantized_logits_differ_from_weight_only_and_match_the_hooked_oracle(dense, tmp_path):
    """The same int8 weights run W8A8 and weight-only (activations switched off), through prefill chunks and
    decode steps: every weight-only row is the plain oracle's and differs from its W8A8 row by far more than
    the tolerance; the W8A8 rows are the hooked oracle's (the median row within it) but where an activation
    on a half-step tie rounded apart in the two (module docstring)."""
    quantized, reference, _ = write_w8a8(dense, tmp_path, CHANNEL, DYNAMIC)
    model, config = load_model(quantized, torch.float32, CPU)
    tokens, steps = decode_schedule()
    w8a8, _ = run_steps(model, config, tokens, steps, seed=3)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.activations = None
    weight_only, _ = run_steps(model, config, tokens, steps, seed=3)
    hooked, plain = hooked_hf(reference, None), load_hf(reference)
    hooked_rows = {key: hooked(torch.tensor([seq])).logits[0] for key, seq in tokens.items()}
    plain_rows = {key: plain(torch.tensor([seq])).logits[0] for key, seq in tokens.items()}
    errors, gaps = [], []
    for (key, position, ours), (_, _, theirs) in zip(w8a8, weight_only):
        torch.testing.assert_close(theirs, plain_rows[key][position], rtol=ROW_ATOL, atol=ROW_ATOL)
        errors.append(float((ours - hooked_rows[key][position]).abs().max()))
        gaps.append(float((ours - theirs).abs().max()))
    assert sorted(errors)[len(errors) // 2] <= ROW_ATOL  # the median row: the same arithmetic
    assert min(gaps) > 100 * ROW_ATOL  # every row: the activations were quantized


def test_quantize_rows_by_hand():
    x = torch.tensor([[0.5, -1.0, 0.25, 2.0],  # max 2: step 2/127, 0.25 -> 15.875 -> 16, 0.5 -> 31.75 -> 32
                      [0.0, 0.0, 0.0, 0.0],  # a row of zeros: zeros, scale 0
                      [127.0, 2.5, -0.5, 1.5]])  # step 1: halves round to even (2.5 -> 2, -0.5 -> -0, 1.5 -> 2)
    levels, scale = quantize_int8_rows(x)
    assert torch.equal(levels, torch.tensor([[32.0, -64.0, 16.0, 127.0], [0.0] * 4, [127.0, 2.0, -0.0, 2.0]]))
    assert torch.equal(scale, torch.tensor([[2.0 / 127], [0.0], [1.0]]))
    static = torch.tensor([0.5])  # x / 0.5, clamped to int8's range: 300 -> 127, -300 -> -128 (-128 is int8's)
    levels, scale = quantize_int8_rows(torch.tensor([[300.0, -300.0, 1.25, -63.75]], dtype=torch.bfloat16), static)
    assert levels.dtype == torch.bfloat16 and scale is static
    assert torch.equal(levels.float(), torch.tensor([[127.0, -128.0, 2.0, -128.0]]))
    with pytest.raises(ValueError, match="positive finite"):
        Int8Activations(torch.tensor([0.0]))


def test_a_w8a8_module_scales_the_int8_matmuls_rows():
    """y = s_m * (q_m . W): the matmul gets the integers, each output row its token's scale."""
    torch.manual_seed(0)
    weights = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    packed_scales = torch.rand(8, 1) / 100
    module = QuantizedLinear(PackedWeights(8, weights, packed_scales), KernelBackend(), Int8Activations())
    x = torch.randn(3, 64)
    levels, scale = quantize_int8_rows(x)
    want = scale * (levels.double() @ (weights.double() * packed_scales.double()).t())
    torch.testing.assert_close(module(x).double(), want, rtol=1e-6, atol=1e-6)


def with_activations(**changes) -> dict:
    raw = copy.deepcopy(W8A8)
    raw["config_groups"]["group_0"]["input_activations"].update(changes)
    return raw


def with_weights(**changes) -> dict:
    raw = copy.deepcopy(W8A8)
    raw["config_groups"]["group_0"]["weights"].update(changes)
    return raw


@pytest.mark.parametrize("raw, want", [
    (W8A8, "compressed-tensors (8-bit, one scale per row, symmetric; int-quantized; int8 activations per token, "
           "dynamic)"),
    (compressed_config("int-quantized", GROUPS, STATIC),
     "compressed-tensors (8-bit, groups of 64, symmetric; int-quantized; int8 activations per tensor, static)"),
    (compressed_config("pack-quantized", CHANNEL, {"num_bits": 8, "type": "int", "group_size": None,
                                                   "dynamic": False}),  # strategy inferred: tensor
     "compressed-tensors (8-bit, one scale per row, symmetric; pack-quantized; int8 activations per tensor, static)"),
])
def test_supported_w8a8_configs(raw, want):
    assert parse_quantization_config(raw).describe() == want


@pytest.mark.parametrize("raw, message", [
    (with_activations(symmetric=False), "asymmetric int8 activations"),
    (with_activations(strategy="group", group_size=128), "strategy 'group'"),
    (with_activations(strategy="token", dynamic=False), "strategy 'token' and dynamic False"),
    (with_activations(strategy="tensor", dynamic=True), "strategy 'tensor' and dynamic True"),
    (with_activations(strategy="tensor", dynamic="local"), "dynamic 'local'"),
    (with_activations(strategy="channel"), "strategy 'channel'"),
    (with_activations(num_bits=4), "4-bit int activations"),
    (with_activations(type="float"), "8-bit float activations"),
    (with_weights(num_bits=4, strategy="group", group_size=128), "W4A8"),
    (with_weights(symmetric=False), "8-bit int weights with zero points"),
    (with_weights(strategy="tensor"), "strategy 'tensor'"),
    (compressed_config("int-quantized", CHANNEL, "int8"), "input_activations must be an object"),
])
def test_unsupported_w8a8_configs_are_refused_with_what_is_supported(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


def test_static_checkpoints_need_their_scales(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=25, dtype=torch.bfloat16)
    quantized, _, scales = write_w8a8(dense, tmp_path, CHANNEL, STATIC)
    tensors = read_weights(quantized)
    name = "model.layers.1.mlp.down_proj"
    for change, message in ((lambda t: t.pop(f"{name}.input_scale"), f"lacks {name}.input_scale"),
                            (lambda t: t.update({f"{name}.input_scale": torch.tensor([0.0])}), "one positive float"),
                            (lambda t: t.update({f"{name}.input_zero_point": torch.tensor([3], dtype=torch.int8)}),
                             "asymmetric int8 activations")):
        broken = dict(tensors)
        change(broken)
        save_file(broken, str(quantized / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_model(quantized, torch.float32, CPU)


# --- compressed-tensors' own compressor as the layout oracle ----------------------------------------------

@pytest.mark.parametrize("activations", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_library_compressed_w8a8_checkpoint(activations, tmp_path):
    """int-quantized W8A8 compressed by compressed-tensors itself (static: the module's input_scale and the
    all-zero input_zero_point its initialisation adds, which the compressor drops): mili's weights are the
    library's, and greedy tokens the hooked oracle's on them."""
    pytest.importorskip("compressed_tensors")
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=26, dtype=torch.bfloat16)
    scales = None
    if not activations["dynamic"]:
        plain = {name: tensor.float() for name, tensor in read_weights(dense).items()}
        scales = calibrated_scales(write_checkpoint(dense, tmp_path / "plain", plain, None),
                                   random_prompts(3, [20, 70], seed=5, vocab=QUANT_VOCAB))

    def extra(prefix: str) -> dict[str, torch.Tensor] | None:
        if scales is None:
            return None
        return {"input_scale": torch.tensor([scales[prefix]], dtype=torch.bfloat16),
                "input_zero_point": torch.zeros(1, dtype=torch.int8)}

    quantized, plain, library = write_library_checkpoint(dense, tmp_path / "quantized", "int-quantized", CHANNEL,
                                                         activations, extra)
    stored = read_weights(quantized)
    assert not any(name.endswith("input_zero_point") for name in stored)
    assert all((f"{p}.input_scale" in stored) == (scales is not None) for p in library)
    model, config = load_model(quantized, torch.float32, CPU)
    for layer in range(config.num_hidden_layers):
        block = model.model.layers[layer]
        for module_name, want in library_fused(library, layer).items():
            assert torch.equal(dequantized_weight(block.get_submodule(module_name)), want)
    reference = write_checkpoint(dense, tmp_path / "reference", plain, None)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11, vocab=QUANT_VOCAB)
    hf = hooked_hf(reference, scales)
    expected = [hf_greedy(hf, prompt, MAX_NEW) for prompt in prompts]
    llm = LLM(str(quantized), dtype="float32", num_pages=128)
    assert_greedy_up_to_near_ties(llm.generate(prompts, greedy(MAX_NEW)), expected)


@needs_kernels
@pytest.mark.parametrize("activations", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_bf16_kernels_as_close_to_the_hooked_oracle_as_transformers_bf16(activations, tmp_path):
    """bf16 runs the compiled kernels: decode rows through the W8A8 kernel (int8 x int8, where the CPU has VNNI),
    in the decode stack and layer by layer, prefill chunks through the int8 GEMM on the int8 levels; as close to
    the fp32 hooked oracle as bf16 transformers with the same hook is."""
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=27, dtype=torch.bfloat16)
    quantized, reference, scales = write_w8a8(dense, tmp_path, CHANNEL, activations)
    model, config = load_model(quantized, torch.bfloat16, CPU)
    modules = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert model.backend.quantized_matmul is not reference_linear
    assert all(m.backend is model.backend and m.packed.int8_inputs is not None for m in modules)
    int8_products = load_cpu_kernels()._module.cpu_has_int8_dot_products()
    assert all(load_cpu_kernels().quantized.supports(m.packed) == int8_products for m in modules)
    assert (model.model.decode_stack is not None) == int8_products  # the stack quantizes x in the kernel
    hf32, hf16 = hooked_hf(reference, scales), hooked_hf(reference, scales, torch.bfloat16)
    assert_as_close_as_transformers_bf16(model, config, hf32, hf16)
    model.model.decode_stack = None  # decode rows module by module
    assert_as_close_as_transformers_bf16(model, config, hf32, hf16)
