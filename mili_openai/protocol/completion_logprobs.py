"""The legacy completions `logprobs` object: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.

Each token is shown as its own decoded text. `top_logprobs[i]` maps the chosen token plus the top-k
alternatives to their logprobs (k = the request's `logprobs`). Echoed prompt tokens carry the engine's
scores of the prompt (`SamplingParams.prompt_logprobs`); the first has none (`null`), as in OpenAI's API.
"""

from __future__ import annotations

from typing import Any

from mili_openai.engine.outputs import TokenLogprob


class CompletionLogprobs:
    """Builds the logprobs object of one choice, piece by piece (a stream) or all at once."""

    def __init__(self, tokenizer: Any, top_k: int) -> None:
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.offset = 0  # characters of the choice's text before the next token

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
