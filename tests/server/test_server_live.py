"""A real uvicorn on 127.0.0.1 driven by the real openai SDK (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import orjson
import pytest

from helpers_server import REAL_ENGINE_CONFIG, TEST_MODEL_NAME, live_server, sse_data, wait_until
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app
from test_server_errors import BAD_COMPLETIONS

NUM_CONCURRENT_STREAMS = 32
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # several 16-token pages
# a long context, so a request that is disconnected early is still far from done when the abort lands
LIVE_ENGINE_CONFIG = {**REAL_ENGINE_CONFIG, "max_model_len": 4096, "num_pages": 320}
LONG_GENERATION = 4000


@pytest.fixture(scope="module")
def live(tiny_checkpoint):
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **LIVE_ENGINE_CONFIG))
    app = create_app(ServerConfig(served_model_name=TEST_MODEL_NAME, request_timeout_s=60.0), engine=engine)
    with live_server(app) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)


def greedy_completion(client, prompt="The quick brown fox", max_tokens=12, **kwargs):
    return client.completions.create(model=TEST_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)


def test_sync_completion_shape(client):
    completion = greedy_completion(client)
    assert completion.object == "text_completion" and completion.model == TEST_MODEL_NAME
    [choice] = completion.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12


def test_greedy_is_deterministic_and_stream_matches(client):
    plain = greedy_completion(client).choices[0].text
    assert greedy_completion(client).choices[0].text == plain
    stream = greedy_completion(client, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        assert chunk.object == "text_completion"
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == plain
    assert finishes == ["length"] and usage.completion_tokens == 12


def test_n_logprobs_echo(client):
    completion = client.completions.create(model=TEST_MODEL_NAME, prompt="Hello", max_tokens=5, n=3, logprobs=2,
                                           echo=True, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.text.startswith("Hello")
        logprobs = choice.logprobs
        num_prompt = completion.usage.prompt_tokens
        assert len(logprobs.tokens) == num_prompt + 5 == len(logprobs.token_logprobs) == len(logprobs.text_offset)
        assert logprobs.token_logprobs[0] is None  # prompt tokens are not scored
        generated = logprobs.token_logprobs[num_prompt:]
        assert all(lp <= 0 for lp in generated)
        assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[num_prompt:])
    assert completion.usage.completion_tokens == 15


def test_seed_reproducible(client):
    def sample():
        return [c.text for c in client.completions.create(
            model=TEST_MODEL_NAME, prompt="Once upon", max_tokens=10, n=2, temperature=1.0, seed=1234,
            extra_body={"ignore_eos": True}).choices]

    first = sample()
    assert sample() == first
    assert first[0] != first[1]


def test_stop_string(client):
    text = greedy_completion(client, max_tokens=16).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = greedy_completion(client, max_tokens=16, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_async_client_and_concurrent_streams(live):
    async def one(client, index):
        stream = await client.completions.create(model=TEST_MODEL_NAME, prompt=f"Request number {index}",
                                                 max_tokens=8, stream=True, temperature=0.7, seed=index,
                                                 extra_body={"ignore_eos": True})
        finishes, text = [], ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        return finishes

    async def main():
        async with openai.AsyncOpenAI(base_url=live.api_base, api_key="unused", max_retries=0) as client:
            plain = await client.completions.create(model=TEST_MODEL_NAME, prompt="async", max_tokens=3)
            results = await asyncio.gather(*(one(client, i) for i in range(NUM_CONCURRENT_STREAMS)))
        return plain, results

    plain, results = asyncio.run(main())
    assert plain.choices[0].finish_reason in ("length", "stop")
    assert results == [["length"]] * NUM_CONCURRENT_STREAMS


def test_raw_sse_wire_format(live):
    body = {"model": TEST_MODEL_NAME, "prompt": "Raw", "max_tokens": 6, "n": 2, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.api_base + "/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert "\n\n" in raw
    events = sse_data(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [orjson.loads(e) for e in events[:-1]]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]
                if c["choices"][0]["finish_reason"] is not None]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_inputs_over_the_wire(live, body, status, param):
    payload = body if "model" in body else {"model": TEST_MODEL_NAME, **body}
    response = httpx.post(live.api_base + "/completions", json=payload)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_sdk_maps_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TEST_MODEL_NAME, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def pages_back(engine) -> bool:
    stats = engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and (
        stats.num_free_pages + stats.num_cached_pages == stats.num_pages)


def test_disconnected_stream_is_aborted(live):
    before = live.engine.stats().generation_tokens_total
    body = {"model": TEST_MODEL_NAME, "prompt": "Disconnect me", "max_tokens": LONG_GENERATION, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", live.api_base + "/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived: now hang up
    assert wait_until(lambda: pages_back(live.engine))
    assert live.engine.stats().generation_tokens_total - before < LONG_GENERATION  # stopped early


def test_disconnected_plain_request_is_aborted(live):
    """The client hangs up once the engine runs its request (a raw socket, closed: no client timeout decides
    when, so the request is always running when the connection goes)."""
    before = live.engine.stats().generation_tokens_total
    body = orjson.dumps({"model": TEST_MODEL_NAME, "prompt": "Disconnect me too", "max_tokens": LONG_GENERATION,
                         "ignore_eos": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", live.port)) as connection:
        connection.sendall(head + body)
        assert wait_until(lambda: live.engine.stats().num_running == 1)
    assert wait_until(lambda: pages_back(live.engine))
    assert live.engine.stats().generation_tokens_total - before < LONG_GENERATION


def test_repeated_long_prompt_reports_cached_tokens(client):
    first = greedy_completion(client, prompt=LONG_PROMPT, max_tokens=2)
    second = greedy_completion(client, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0
