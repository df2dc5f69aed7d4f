"""Chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.

`bytes` are the token's real UTF-8 bytes. A byte-level BPE token can hold part of a multi-byte
character, so decoding it alone gives U+FFFD; its bytes still let a client rebuild the text exactly.
They come from the token's vocabulary string through GPT-2's byte <-> unicode table, which the
Qwen tokenizer uses; added tokens (`<think>`, `<|im_end|>`) are literal text and map the same way.
"""

from __future__ import annotations

import functools
from typing import Any

from mili_openai.engine.outputs import TokenLogprob
from mili_openai.protocol.chat import ChoiceLogprobs, TokenLogprobOut, TopLogprob

BYTE_COUNT = 256


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the other
    bytes were shifted to code points 256+ in order, so every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(BYTE_COUNT):
        if b not in printable:
            table[chr(BYTE_COUNT + shifted)] = b
            shifted += 1
    return table


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    table = unicode_to_byte()
    if all(char in table for char in piece):
        return bytes(table[char] for char in piece)
    return piece.encode("utf-8")  # not byte-level encoded (a literal added token)


def _entry(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    raw = token_bytes(tokenizer, token_id)
    return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob], top_k: int) -> ChoiceLogprobs:
    """The logprobs object for some generated tokens (a whole choice, or one streamed delta)."""
    content = []
    for entry in logprobs:
        chosen = _entry(tokenizer, entry.token_id, entry.logprob)
        top = [_entry(tokenizer, token_id, logprob) for token_id, logprob in entry.top[:top_k]]
        content.append(TokenLogprobOut(**chosen.model_dump(), top_logprobs=top))
    return ChoiceLogprobs(content=content)
