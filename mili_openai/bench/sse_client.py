"""One streamed OpenAI request, timed: TTFT, inter-token latencies, end-to-end latency, token counts.

Works for both /v1/completions (`choices[0].text`) and /v1/chat/completions (`choices[0].delta.content`,
plus reasoning fields, which are output tokens too). Output tokens come from the final usage chunk when
the server sends one, else from the number of chunks that carried text — `output_tokens_source` says
which, because a server that packs several tokens in one chunk makes the chunk count an undercount.

The client is aiohttp, whose HTTP parser is compiled: on a small machine the load generator shares
the cores with the server it measures, and httpx (pure-Python h11 and anyio underneath) took about twice
aiohttp's CPU per streamed event.

Request bodies (`request_body`): always streaming, with the usage chunk asked for, and greedy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import aiohttp
import orjson

from mili_openai.bench.config import MULTI_TURN, BenchConfig
from mili_openai.bench.datasets import BenchRequest

SSE_DATA_PREFIX = b"data:"
SSE_DONE = b"[DONE]"
# Enough of an error body to tell what went wrong, short enough for a table.
MAX_ERROR_CHARS = 300
# Chat delta fields that carry generated text; the reasoning ones hold Qwen3's thinking tokens.
CHAT_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")

# Greedy decoding: identical work for every server and no sampler cost differences in the comparison.
BENCH_TEMPERATURE = 0.0

SOURCE_USAGE = "usage"
SOURCE_CHUNKS = "chunks"


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
        if config.prompt_as_ids and config.dataset == MULTI_TURN:  # the replies come back as ids: vLLM's field,
            body["return_token_ids"] = True
            body["verbose"] = True  # and llama.cpp's server's (each chunk's `__verbose.tokens`); others ignore it
    # vLLM extra-body fields: sent only when asked, since strict OpenAI peers reject unknown fields.
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.min_tokens is not None:
        body["min_tokens"] = config.min_tokens
    body.update(config.extra_fields())  # last, so a peer-specific field can override ours
    return body


def completion_prompt(config: BenchConfig, request: BenchRequest) -> str | list[int]:
    prefix = request.prefix
    if config.prompt_as_ids:  # a history as the model saw it: the replies' ids as the server returned them
        history_ids = [token for user, reply in request.history for token in (*user.token_ids, *reply.token_ids)]
        return list(prefix.token_ids if prefix is not None else ()) + history_ids + list(request.body.token_ids)
    history = "".join(user.text + reply.text for user, reply in request.history)
    return (prefix.text if prefix is not None else "") + history + request.body.text


def chat_messages(request: BenchRequest) -> list[dict[str, str]]:
    messages = []
    if request.prefix is not None:
        messages.append({"role": "system", "content": request.prefix.text})
    for user, reply in request.history:
        messages += [{"role": "user", "content": user.text}, {"role": "assistant", "content": reply.text}]
    messages.append({"role": "user", "content": request.body.text})
    return messages


def request_headers(config: BenchConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # usage.prompt_tokens when sent, else the dataset's count
    # prompt tokens the server served from its prefix cache: usage.prompt_tokens_details.cached_tokens (OpenAI's,
    # mili's), else llama.cpp's timings.cache_n; None where the server reports neither
    cached_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = SOURCE_CHUNKS
    ttft_s: float | None = None  # first chunk carrying text; None if none came
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    start_s: float = 0.0  # send time relative to the start of the run
    finish_reason: str | None = None
    error: str | None = None
    turn: int | None = None  # multi-turn: the request's turn in its conversation (1 = the first)
    text: str = ""  # the generated text (a multi-turn conversation resends it); not written to the JSON
    # the generated ids, where the server returned them (`return_token_ids`); not written to the JSON either
    token_ids: list[int] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "success": self.success, "prompt_len": self.prompt_len, "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s, "itl_s": self.itl_s, "start_s": self.start_s,
            "finish_reason": self.finish_reason, "error": self.error, "cached_tokens": self.cached_tokens,
            "turn": self.turn,
        }


class _StreamState:
    """What the stream told us so far; turned into a RequestResult at the end (success or not)."""

    def __init__(self, prompt_len: int, started: float) -> None:
        self.result = RequestResult(prompt_len=prompt_len)
        self.started = started
        self.last_text_at: float | None = None
        self.text_chunks = 0
        self.saw_event = False
        self.usage_tokens: int | None = None
        self.texts: list[str] = []  # the first choice's text pieces, joined at the end

    def on_event(self, event: dict[str, Any], now: float) -> None:
        self.saw_event = True
        if "error" in event:
            raise StreamError(_error_text(event["error"]))
        for choice in event.get("choices") or ():
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
            text = _choice_text(choice)
            if text:
                self._on_text(now)
                if choice.get("index", 0) == 0:
                    self.texts.append(text)
            if choice.get("index", 0) == 0:
                self.result.token_ids.extend(choice.get("token_ids") or _llama_token_ids(event))
        usage = event.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
            self.result.prompt_len = usage.get("prompt_tokens", self.result.prompt_len)
        cached = _cached_tokens(usage or {}, event.get("timings") or {})
        if cached is not None:
            self.result.cached_tokens = cached

    def _on_text(self, now: float) -> None:
        self.text_chunks += 1
        if self.last_text_at is None:
            self.result.ttft_s = now - self.started
        else:
            self.result.itl_s.append(now - self.last_text_at)
        self.last_text_at = now

    def finish(self, now: float, error: str | None) -> RequestResult:
        result = self.result
        result.e2e_s = now - self.started
        result.text = "".join(self.texts)
        if self.usage_tokens is not None:
            result.output_tokens, result.output_tokens_source = self.usage_tokens, SOURCE_USAGE
        else:
            result.output_tokens, result.output_tokens_source = self.text_chunks, SOURCE_CHUNKS
        if error is None and not self.saw_event:
            error = "stream ended without any event"
        result.error = error
        result.success = error is None
        return result


class StreamError(Exception):
    """The server reported an error inside the stream or in a non-200 answer."""


async def stream_request(client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                         prompt_len: int, timeout_s: float) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network failures."""
    started = time.perf_counter()
    state = _StreamState(prompt_len, started)
    error: str | None = None
    try:
        # One deadline for the whole exchange: the session's own timeouts are per read and would let a
        # slow trickle of tokens run forever.
        await asyncio.wait_for(_consume(client, url, body, headers, state), timeout=timeout_s)
    except asyncio.TimeoutError:
        error = f"timeout after {timeout_s:g} s"
    except StreamError as exc:
        error = str(exc)
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a malformed JSON event
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return state.finish(time.perf_counter(), error)


async def _consume(client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                   state: _StreamState) -> None:
    async with client.post(url, data=orjson.dumps(body),
                           headers={**headers, "Content-Type": "application/json"}) as response:
        if response.status != HTTPStatus.OK:
            text = (await response.read()).decode("utf-8", "replace")
            raise StreamError(f"HTTP {response.status}: {text[:MAX_ERROR_CHARS]}")
        async for line in response.content:  # one line at a time, its end included
            if not line.startswith(SSE_DATA_PREFIX):
                continue  # blank separators, `event:` names, `:` keep-alive comments
            data = line[len(SSE_DATA_PREFIX):].strip()
            if data == SSE_DONE:
                return
            if data:
                state.on_event(orjson.loads(data), time.perf_counter())


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return "".join(delta.get(name) or "" for name in CHAT_TEXT_FIELDS)
    return choice.get("text") or ""


def _llama_token_ids(event: dict[str, Any]) -> list[int]:
    """The ids llama.cpp's server generated for a chunk (its `__verbose` debug field, asked for with `verbose`)."""
    return (event.get("__verbose") or {}).get("tokens") or []


def _cached_tokens(usage: dict[str, Any], timings: dict[str, Any]) -> int | None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens, else llama.cpp's timings.cache_n (its own field)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")
    return cached if isinstance(cached, int) else None


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:MAX_ERROR_CHARS]
