"""Wire types of POST /v1/completions: the request model and the response / chunk builders."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from mili_openai.engine.sampling_params import MAX_LOGPROBS
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.sampling import (
    DEFAULT_MAX_TOKENS,
    MAX_N,
    PromptLogprobsField,
    SamplingFields,
    StreamOptions,
    check_prompt_logprobs,
)

COMPLETION_OBJECT = "text_completion"
SYSTEM_FINGERPRINT = "mili-openai"
MAX_PROMPTS = 64  # prompts in one batched request

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
PromptInput = str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds | Annotated[
    list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)
]


class CompletionRequest(SamplingFields):
    # 0 with `echo`: score the prompt and generate nothing (OpenAI's legacy API and vLLM accept it)
    max_tokens: Annotated[int, Field(ge=0)] | None = DEFAULT_MAX_TOKENS
    prompt: PromptInput
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    prompt_logprobs: PromptLogprobsField = None  # vLLM's: scores of the prompt tokens, on each choice
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # vLLM's: each choice carries its prompt's token ids and the generated ids (streamed: the prompt's on the
    # first chunk, each chunk its own), so a client can resend a history exactly as the model saw it
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (ranking extra samples is not supported)")
        if self.max_tokens == 0 and not self.echo:  # an APIError passes through pydantic, naming its field
            raise APIError(400, "max_tokens: 0 is only allowed with echo (the prompt alone comes back)",
                           param="max_tokens")
        return self

    @property
    def scored_prompt_top_k(self) -> int | None:
        """The engine's prompt_logprobs: for vLLM's field, and for echo with logprobs (the wider of the two)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    @property
    def echo_only(self) -> bool:
        """Echo the prompt (with its scores when logprobs are on) and return no generated token."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def completion_object(
    response_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None,
    include_usage_key: bool = True,
) -> dict[str, Any]:
    """One `text_completion` object: a whole response, or one streamed chunk."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": COMPLETION_OBJECT,
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if include_usage_key:
        body["usage"] = usage
    return body


def choice_object(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None,
                  stop_reason: str | int | None = None, prompt_logprobs: list | None = None,
                  token_ids: tuple[list[int] | None, list[int]] | None = None) -> dict[str, Any]:
    """One choice; `token_ids`: (its prompt's ids or None, its generated ids), for `return_token_ids`."""
    # stop_reason is vLLM's extra: the stop string or token id that ended the choice
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if prompt_logprobs is not None:  # vLLM's extra, only when the request asked for it
        choice["prompt_logprobs"] = prompt_logprobs
    if token_ids is not None:  # vLLM's extras, as it names them
        prompt_ids, generated = token_ids
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = generated
    return choice
