"""Quantized weights on a CUDA device: fp8's two paths (the Triton weight-only kernel against the matmul on
the dequantized weights; the Triton activation quantization bit for bit against torch's, and _scaled_mm
against its float32 emulation), the int8/int4 Triton kernels against the torch reference, and quantized
engines against transformers on the dequantized weights, with and without CUDA graphs. Skipped where torch
sees no GPU (fp8 matmuls also need Hopper or later)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, hf_greedy, load_hf, random_prompts
from quant_helpers import QUANT_SHAPE, QUANT_VOCAB, write_dequantized

from mili_openai import LLM, SamplingParams
from mili_openai.kernels.fp8 import (
    WEIGHT_ONLY_MAX_ROWS,
    Fp8Weights,
    per_row_weights,
    quantize_rows_fp8,
    torch_fp8_linear,
    uses_weight_only,
    w8a8_reference,
    weight_only_reference,
)
from mili_openai.kernels.quantized import reference_linear
from mili_openai.model import build_random_checkpoint, load_model
from mili_openai.model.quantization.dynamic import quantize_fp8, quantize_int4, quantize_int8
from mili_openai.model.quantization.modules import Fp8Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
CUDA = torch.device("cuda")
FP8_RTOL = 2e-2  # W8A8: the same e4m3 values on both sides; sums in another order, outputs rounded to bf16
WEIGHT_ONLY_RTOL = 2 ** -7  # the same products summed in another order: an output bf16 step apart
HOPPER = (9, 0)


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= HOPPER


@pytest.mark.skipif(not fp8_capable(), reason="fp8 matmuls need compute capability 9.0 or later")
@pytest.mark.parametrize("rows", [1, 8, 100, WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS + 1, 300])
def test_fp8_paths_match_their_references_on_the_gpu(rows):
    """Triton and torch forms alike: weight-only rows against the float32 matmul on the dequantized weights,
    W8A8 rows (_scaled_mm) against its float32 emulation on the CPU."""
    from mili_openai.kernels.triton_fp8 import triton_fp8_linear

    weights = per_row_weights(*quantize_fp8(torch.randn(304, 1024) / 16))
    on_gpu = Fp8Weights(weights.weight.to(CUDA), weights.scales.to(CUDA), weights.block)
    x = torch.randn(rows, 1024, dtype=torch.bfloat16)
    weight_only = uses_weight_only(rows, x.dtype, weights)
    want = (weight_only_reference if weight_only else w8a8_reference)(x, weights).float()
    rtol = WEIGHT_ONLY_RTOL if weight_only else FP8_RTOL
    for matmul in (triton_fp8_linear, torch_fp8_linear):
        got = matmul(x.to(CUDA), on_gpu).float().cpu()
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.skipif(not fp8_capable(), reason="Triton's e4m3 conversions need compute capability 9.0 or later")
def test_fp8_triton_kernels_match_torch_on_the_gpu():
    """The activation quantization bit for bit against torch's on the CPU, and the weight-only kernel with a
    fine-grained checkpoint's 128x128 block scales. (Not against torch's on the GPU: there `amax / 448` divides by
    a CPU scalar, which torch's CUDA kernel does as a multiply by its reciprocal, a bit off IEEE division in some
    rows; the kernel divides as IEEE does, as torch's CPU kernel does. Seen on an H200, 2026-11-30.)"""
    from mili_openai.kernels.triton_fp8 import quantize_rows, triton_fp8_linear

    x = torch.randn(37, 3000, device=CUDA, dtype=torch.bfloat16) * torch.logspace(-6, 2, 3000, device=CUDA)
    x[3] = 0
    q, scales = quantize_rows(x)
    want_q, want_scales = (tensor.to(CUDA) for tensor in quantize_rows_fp8(x.cpu()))
    assert torch.equal(scales, want_scales) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    q = (torch.randn(400, 640) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = Fp8Weights(q, torch.rand(4, 5) / 256 + 1e-4, (128, 128))
    on_gpu = Fp8Weights(q.to(CUDA), blocks.scales.to(CUDA), blocks.block)
    for rows in (1, 64, 300):
        x = torch.randn(rows, 640, dtype=torch.bfloat16)
        want = weight_only_reference(x, blocks).float()
        got = triton_fp8_linear(x.to(CUDA), on_gpu).float().cpu()
        torch.testing.assert_close(got, want, rtol=WEIGHT_ONLY_RTOL, atol=WEIGHT_ONLY_RTOL * float(want.abs().max()))


def test_triton_kernels_match_the_reference_on_the_gpu():
    from mili_openai.kernels.triton_quantized import triton_quantized_linear

    assert triton_quantized_linear is not None
    w = torch.randn(300, 1024, device=CUDA) / 16
    for packed in (quantize_int8(w), quantize_int4(w, 128), quantize_int4(w, 32)):
        for rows in (1, 8, 100):
            x = torch.randn(rows, 1024, device=CUDA, dtype=torch.bfloat16)
            got, want = triton_quantized_linear(x, packed).float(), reference_linear(x, packed).float()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_engine_on_the_gpu_matches_transformers(method, tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=9)
    model, _ = load_model(dense, torch.float32, torch.device("cpu"), quantization=method)
    hf = load_hf(write_dequantized(model, dense, tmp_path / "dequantized"))
    prompts = random_prompts(3, [5, 40, 130], seed=12, vocab=QUANT_VOCAB)
    expected = [hf_greedy(hf, prompt, 8) for prompt in prompts]
    llm = LLM(str(dense), dtype="float32", device="cuda", num_pages=64, quantization=method)
    assert_matches(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)),
                   expected)


@pytest.mark.skipif(not fp8_capable(), reason="fp8 matmuls need compute capability 9.0 or later")
def test_fp8_engine_in_float32_matches_transformers_on_the_dequantized_weights(tmp_path):
    """float32 activations run weight-only at every size (no activation quantization): transformers' greedy
    tokens on the dequantized weights, through prefill and decode steps replayed from CUDA graphs."""
    from mili_openai.kernels.triton_fp8 import triton_fp8_linear

    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=11)
    model, _ = load_model(dense, torch.float32, CUDA, quantization="fp8")
    layers = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    assert len(layers) == 4 * model.config.num_hidden_layers
    assert all(layer.backend is model.backend for layer in layers) and model.backend.fp8_matmul is triton_fp8_linear
    hf = load_hf(write_dequantized(model, dense, tmp_path / "dequantized"))
    prompts = random_prompts(3, [5, 40, 200], seed=14, vocab=QUANT_VOCAB)
    expected = [hf_greedy(hf, prompt, 8) for prompt in prompts]
    llm = LLM(str(dense), dtype="float32", device="cuda", num_pages=64, quantization="fp8")
    assert llm.core.runner.forward.decode_graphs is not None
    assert_matches(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)),
                   expected)


@pytest.mark.skipif(not fp8_capable(), reason="fp8 matmuls need compute capability 9.0 or later")
def test_fp8_decode_steps_replay_from_cuda_graphs(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=10, dtype=torch.bfloat16)
    prompts = random_prompts(3, [5, 40, 130], seed=13, vocab=QUANT_VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(dense), device="cuda", num_pages=64, quantization="fp8", enforce_eager=eager)
        assert (llm.core.runner.forward.decode_graphs is None) == eager
        runs[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert runs[True] == runs[False]
