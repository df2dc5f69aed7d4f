"""OpenAI request bodies for one benchmark request: always streaming, with the usage chunk asked for."""

from __future__ import annotations

from typing import Any

from mili_openai.bench.config import BenchConfig
from mili_openai.bench.datasets import BenchRequest

# Greedy decoding: identical work for every server and no sampler cost differences in the comparison.
BENCH_TEMPERATURE = 0.0


def request_body(config: BenchConfig, model: str, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": BENCH_TEMPERATURE,
        "stream": True,
        # The final usage chunk gives the server's own token counts (prompt incl. template, output).
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = chat_messages(request)
    else:
        body["prompt"] = completion_prompt(config, request)
    # vLLM extra-body fields: sent only when asked, since strict OpenAI peers reject unknown fields.
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.min_tokens is not None:
        body["min_tokens"] = config.min_tokens
    body.update(config.extra_fields())  # last, so a peer-specific field can override ours
    return body


def completion_prompt(config: BenchConfig, request: BenchRequest) -> str | list[int]:
    prefix = request.prefix
    if config.prompt_as_ids:
        return list(prefix.token_ids if prefix is not None else ()) + list(request.body.token_ids)
    return (prefix.text if prefix is not None else "") + request.body.text


def chat_messages(request: BenchRequest) -> list[dict[str, str]]:
    messages = []
    if request.prefix is not None:
        messages.append({"role": "system", "content": request.prefix.text})
    messages.append({"role": "user", "content": request.body.text})
    return messages


def request_headers(config: BenchConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers
