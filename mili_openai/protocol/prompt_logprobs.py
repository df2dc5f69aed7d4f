"""vLLM's `prompt_logprobs` request field and its response shape, on /v1/completions and /v1/chat/completions.

A request with `"prompt_logprobs": k` gets, per prompt token, `null` for the first and otherwise
`{token_id: {"logprob", "rank", "decoded_token"}}` holding the prompt's own token (its rank among the whole
vocabulary) and the k likeliest tokens (ranks 1..k). vLLM puts the list on each choice of a completion and
on the response of a chat completion, and refuses it with `stream`; so does this server.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from mili_openai.engine.outputs import TokenLogprob
from mili_openai.engine.sampling_params import MAX_LOGPROBS

PromptLogprobsField = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    if prompt_logprobs is not None and stream:
        raise ValueError("prompt_logprobs are not available when stream is true")


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
