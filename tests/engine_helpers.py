"""Shared by the engine tests: an HF transformers oracle and random prompts."""

from __future__ import annotations

import inspect
import random

import torch


def random_prompts(count: int, lengths: list[int], seed: int = 0, vocab: int = 150000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step log-softmax rows from HF transformers' Qwen3 (the oracle)."""
    # transformers 5.24 renamed past_key_values to cache, in the arguments and the output (the old
    # argument warns, and goes in 5.40); earlier versions know only the old name
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    logprob_rows: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(row.argmax())
        tokens.append(token)
        logprob_rows.append(row)
        out = model(torch.tensor([[token]]), use_cache=True, **{cache: getattr(out, cache)})
    return tokens, logprob_rows


def load_hf(path, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
