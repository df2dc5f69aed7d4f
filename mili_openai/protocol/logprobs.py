"""Log-probabilities in their three response shapes.

- Chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
  `bytes` are the token's real UTF-8 bytes. A byte-level BPE token can hold part of a multi-byte
  character, so decoding it alone gives U+FFFD; its bytes still let a client rebuild the text exactly.
  They come from the token's vocabulary string through GPT-2's byte <-> unicode table, which the Qwen
  tokenizer uses; added tokens (`<think>`, `<|im_end|>`) are literal text and map the same way.
- The legacy completions object: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`. Each
  token is shown as its own decoded text; `top_logprobs[i]` maps the chosen token plus the top-k
  alternatives to their logprobs. Echoed prompt tokens carry the engine's scores of the prompt
  (`SamplingParams.prompt_logprobs`); the first has none (`null`), as in OpenAI's API.
- vLLM's `prompt_logprobs`: per prompt token, `null` for the first and otherwise
  `{token_id: {"logprob", "rank", "decoded_token"}}` holding the prompt's own token (its rank among the
  whole vocabulary) and the k likeliest tokens (ranks 1..k). vLLM puts the list on each choice of a
  completion and on the response of a chat completion, and refuses it with `stream`; so does this server.
"""

from __future__ import annotations

import functools
from typing import Any

from mili_openai.engine.outputs import TokenLogprob

BYTE_COUNT = 256


# ---- chat ----
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


class TokenPieces:
    """What logprobs show of each token id, remembered for one request: its text decoded alone (completions),
    its vocabulary text and real bytes (chat). A stream looks up the chosen token and its top-k alternatives
    at every step, mostly the same few ids again, and each first lookup goes through the tokenizer's Python
    layers."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._chat: dict[int, tuple[str, bytes]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def chat_piece(self, token_id: int) -> tuple[str, bytes]:
        """The token's text as chat logprobs show it (U+FFFD for part of a character) and its bytes."""
        piece = self._chat.get(token_id)
        if piece is None:
            raw = token_bytes(self.tokenizer, token_id)
            piece = self._chat[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return piece


def chat_logprobs_object(pieces: TokenPieces, logprobs: list[TokenLogprob], top_k: int) -> dict[str, Any]:
    """A choice's logprobs object as sent (`ChoiceLogprobs.model_dump()`), built as plain dicts: a stream builds
    one per token, where the models would cost several times the dicts."""
    content = []
    for entry in logprobs:
        top = []
        for token_id, logprob in entry.top[:top_k]:
            text, raw = pieces.chat_piece(token_id)
            top.append({"token": text, "logprob": float(logprob), "bytes": list(raw)})
        text, raw = pieces.chat_piece(entry.token_id)
        content.append({"token": text, "logprob": float(entry.logprob), "bytes": list(raw), "top_logprobs": top})
    return {"content": content}


# ---- completions ----
class CompletionLogprobs:
    """Builds the logprobs object of one choice, piece by piece (a stream) or all at once."""

    def __init__(self, pieces: TokenPieces, top_k: int) -> None:
        self.token_text = pieces.text
        self.top_k = top_k
        self.offset = 0  # characters of the choice's text before the next token

    def _empty(self) -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def prompt(self, token_ids: list[int], scored: list[TokenLogprob | None] | None) -> dict[str, list]:
        """Echoed prompt tokens with their scores (one entry per token; None, or no list, = null)."""
        out = self._empty()
        for index, token_id in enumerate(token_ids):
            entry = scored[index] if scored is not None else None
            if entry is None:
                self._append(out, self.token_text(token_id), None, None)
            else:
                self._append_scored(out, entry)
        return out

    def generated(self, logprobs: list[TokenLogprob]) -> dict[str, list]:
        out = self._empty()
        for entry in logprobs:
            self._append_scored(out, entry)
        return out

    def _append_scored(self, out: dict[str, list], entry: TokenLogprob) -> None:
        text = self.token_text(entry.token_id)
        top = {text: entry.logprob}
        for token_id, logprob in entry.top[: self.top_k]:
            top.setdefault(self.token_text(token_id), logprob)
        self._append(out, text, entry.logprob, top)

    def _append(self, out: dict[str, list], text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text)


def merge_logprobs(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + second[key] for key in first}


# ---- prompt_logprobs ----
def prompt_logprobs_object(tokenizer: Any, scored: list[TokenLogprob | None] | None, top_k: int
                           ) -> list[dict | None]:
    """The response's `prompt_logprobs`: one entry per prompt token, with top_k alternatives each."""
    return [_position(tokenizer, entry, top_k) if entry is not None else None for entry in scored or []]


def _position(tokenizer: Any, entry: TokenLogprob, top_k: int) -> dict[str, dict[str, Any]]:
    def described(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank,
                "decoded_token": tokenizer.decode([token_id], skip_special_tokens=False)}

    out = {str(entry.token_id): described(entry.token_id, entry.logprob, entry.rank)}
    for rank, (token_id, logprob) in enumerate(entry.top[:top_k], start=1):
        out.setdefault(str(token_id), described(token_id, logprob, rank))
    return out
