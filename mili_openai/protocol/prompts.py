"""Prompts as the engine takes them (token ids), and helpers that keep tokenisation off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from mili_openai.server.errors import APIError

# Texts longer than this are tokenised on a worker thread: a megabyte of text takes long enough to
# stall every other stream if done on the event loop. Shorter ones are cheaper inline than a hop.
INLINE_TOKENIZE_CHARS = 16_384


async def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)


async def prompt_token_ids(tokenizer: Any, prompts: list[str | list[int]], vocab_size: int) -> list[list[int]]:
    """Each prompt as token ids; text is tokenised with the model's special tokens (like vLLM)."""
    out: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = await encode_text(tokenizer, prompt)
            if not ids:
                raise APIError(400, "the prompt is empty: at least one token is needed", param="prompt")
        else:
            ids = list(prompt)
            check_token_ids(ids, vocab_size)
        out.append(ids)
    return out


def prompt_text(tokenizer: Any, prompt: str | list[int]) -> str:
    """The prompt as text, for `echo` (token-id prompts are decoded)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False)
