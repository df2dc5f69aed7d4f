"""The legacy completions `logprobs` object: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.

Each token is shown as its own decoded text. `top_logprobs[i]` maps the chosen token plus the top-k
alternatives to their logprobs (k = the request's `logprobs`). Echoed prompt tokens carry `null`
logprobs: the engine does not score prompts.
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

    def prompt(self, token_ids: list[int]) -> dict[str, list]:
        """Echoed prompt tokens, with null logprobs."""
        out = self._empty()
        for token_id in token_ids:
            self._append(out, self.token_text(token_id), None, None)
        return out

    def generated(self, logprobs: list[TokenLogprob]) -> dict[str, list]:
        out = self._empty()
        for entry in logprobs:
            text = self.token_text(entry.token_id)
            top = {text: entry.logprob}
            for token_id, logprob in entry.top[: self.top_k]:
                top.setdefault(self.token_text(token_id), logprob)
            self._append(out, text, entry.logprob, top)
        return out

    def _append(self, out: dict[str, list], text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text)


def merge_logprobs(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + second[key] for key in first}
