"""Quantized weights on a CUDA device: fp8 through torch._scaled_mm against its float32 emulation, the
int8/int4 Triton kernels against the torch reference, and quantized engines with and without CUDA graphs.
Skipped where torch sees no GPU (fp8 matmuls also need Hopper or later)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, hf_greedy, load_hf, random_prompts
from quant_helpers import QUANT_SHAPE, write_dequantized

from mili_openai import LLM, SamplingParams
from mili_openai.kernels.quantized import reference_linear
from mili_openai.model import build_random_checkpoint, load_model
from mili_openai.model.quantization.dynamic import quantize_fp8, quantize_int4, quantize_int8
from mili_openai.model.quantization.modules import Fp8Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
CUDA = torch.device("cuda")
FP8_RTOL = 2e-2  # the same e4m3 values on both sides; sums in another order, outputs rounded to bf16
HOPPER = (9, 0)


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= HOPPER


@pytest.mark.skipif(not fp8_capable(), reason="fp8 matmuls need compute capability 9.0 or later")
def test_scaled_mm_matches_its_emulation():
    w = torch.randn(256, 512) / 16
    layer = Fp8Linear(*quantize_fp8(w))
    x = torch.randn(7, 512, dtype=torch.bfloat16)
    want = layer(x.float()).float()  # on CPU: the emulation
    got = layer.to(CUDA)(x.to(CUDA)).float().cpu()
    torch.testing.assert_close(got, want, rtol=FP8_RTOL, atol=FP8_RTOL * float(want.abs().max()))


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
    prompts = random_prompts(3, [5, 40, 130], seed=12)
    expected = [hf_greedy(hf, prompt, 8) for prompt in prompts]
    llm = LLM(str(dense), dtype="float32", device="cuda", num_pages=64, quantization=method)
    assert_matches(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)),
                   expected)


@pytest.mark.skipif(not fp8_capable(), reason="fp8 matmuls need compute capability 9.0 or later")
def test_fp8_decode_steps_replay_from_cuda_graphs(tmp_path):
    dense = build_random_checkpoint(tmp_path / "dense", QUANT_SHAPE, seed=10, dtype=torch.bfloat16)
    prompts = random_prompts(3, [5, 40, 130], seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(dense), device="cuda", num_pages=64, quantization="fp8", enforce_eager=eager)
        assert (llm.core.runner.decode_graphs is None) == eager
        runs[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert runs[True] == runs[False]
