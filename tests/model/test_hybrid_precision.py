"""Qwen3.5 in bf16 and int8 against transformers' fp32 logits: our bf16 (the CPU kernels where the CPU has them:
bf16 matmuls, the compiled delta rule and conv) errs no more than transformers' own bf16 does, and `--quantization
int8` quantizes every projection of both layer kinds and stays within a few times bf16's error."""

from __future__ import annotations

import pytest
import torch

from hybrid_helpers import hybrid_caches, hybrid_tokens, transformers_class, with_state_slots
from model_helpers import PagedSequences

from mili_openai.model import load_model
from mili_openai.model.quantization.modules import QuantizedLinear

LAYOUT = "qwen3_5"
PROMPT, DECODE = 60, 10
BF16_ERROR_RATIO = 1.5  # our bf16 error vs the fp32 oracle, relative to transformers' own bf16 error
INT8_ERROR_RATIO = 4.0  # int8 weights (a scale per row) vs our bf16 error; measured about 2
PROJECTIONS = {"linear_attn.in_proj", "linear_attn.out_proj", "self_attn.qkv_proj", "self_attn.o_proj",
               "mlp.gate_up_proj", "mlp.down_proj"}


@pytest.fixture(scope="module")
def oracle(hybrid_checkpoint):
    """(checkpoint, tokens, transformers' fp32 logits, its bf16 logits' mean error vs them)."""
    checkpoint = hybrid_checkpoint(LAYOUT)
    tokens = hybrid_tokens(PROMPT + DECODE, seed=9)
    logits = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            hf = transformers_class(LAYOUT).from_pretrained(str(checkpoint), dtype=dtype).eval()
            logits[dtype] = hf(torch.tensor([tokens])).logits[0].float()
    return checkpoint, tokens, logits[torch.float32], mean_error(logits[torch.bfloat16], logits[torch.float32])


def mean_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().mean())


@torch.inference_mode()
def our_logits(model, tokens: list[int]) -> torch.Tensor:
    """A prefill of PROMPT tokens then DECODE decode steps -> logits at every position."""
    pages = PagedSequences(16, 16)
    pages.add("a", tokens)
    caches = hybrid_caches(model, 16, 16, 2, model.dtype)
    steps = [([], [("a", PROMPT)])] + [(["a"], [])] * DECODE
    rows = []
    for decode, prefill in steps:
        batch, _ = pages.batch(decode, prefill)
        rows.append(model.compute_logits(model(with_state_slots(batch, decode, prefill, {"a": 1}), caches)))
    return torch.cat(rows)


def test_bf16_errs_no_more_than_transformers_bf16(oracle):
    checkpoint, tokens, want, hf_error = oracle
    model, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"))
    assert mean_error(our_logits(model, tokens), want) <= BF16_ERROR_RATIO * hf_error


def test_int8_quantizes_every_projection(oracle):
    checkpoint, tokens, want, _ = oracle
    dense, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"))
    model, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"), quantization="int8")
    quantized = {name.split(".", 1)[1] for name, module in model.model.layers.named_modules()
                 if isinstance(module, QuantizedLinear)}
    assert quantized == PROJECTIONS and isinstance(model.lm_head, QuantizedLinear)
    assert model.quantization.startswith("int8")
    bf16_error = mean_error(our_logits(dense, tokens), want)
    assert mean_error(our_logits(model, tokens), want) <= INT8_ERROR_RATIO * bf16_error
