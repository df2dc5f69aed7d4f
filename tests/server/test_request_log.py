"""Request ids on every response (errors included) and one JSON log line per finished request."""

from __future__ import annotations

import logging

import orjson
import pytest

from helpers_server import FakeEngine, asgi_client, sse_data
from mili_openai.server.request_log import REQUEST_LOGGER_NAME

pytestmark = pytest.mark.anyio

LOG_FIELDS = {"event", "request_id", "method", "endpoint", "status", "prompt_tokens", "cached_tokens",
              "output_tokens", "num_sequences", "ttft_s", "total_s", "finish_reasons"}


@pytest.fixture
def request_log(caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER_NAME)

    def lines() -> list[dict]:
        records = [r for r in caplog.records if r.name == REQUEST_LOGGER_NAME]
        return [orjson.loads(r.getMessage()) for r in records]

    return lines


def only_line(lines: list[dict], request_id: str) -> dict:
    matching = [line for line in lines if line["request_id"] == request_id]
    assert len(matching) == 1, lines
    assert set(matching[0]) == LOG_FIELDS
    return matching[0]


async def test_completion_line_matches_usage(fake_engine, request_log):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/completions", json={"prompt": "log me", "max_tokens": 4, "n": 2},
                                     headers={"x-request-id": "log-1"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "log-1"
    usage = response.json()["usage"]
    line = only_line(request_log(), "log-1")
    assert line["endpoint"] == "/v1/completions" and line["method"] == "POST" and line["status"] == 200
    assert line["prompt_tokens"] == usage["prompt_tokens"]  # the prompt once, not once per sample
    assert line["output_tokens"] == usage["completion_tokens"] == 8
    assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert line["num_sequences"] == 2 and line["finish_reasons"] == ["length", "length"]
    assert 0 <= line["ttft_s"] <= line["total_s"]


async def test_stream_is_logged_when_it_ends(qwen_tokenizer, request_log):
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.01)
    async with asgi_client(engine) as client:
        response = await client.post("/generate", json={"prompt": "stream me", "max_tokens": 5, "stream": True},
                                     headers={"x-request-id": "log-stream"})
    assert sse_data(response.text)[-1] == "[DONE]"
    line = only_line(request_log(), "log-stream")
    assert line["endpoint"] == "/generate" and line["output_tokens"] == 5
    assert line["finish_reasons"] == ["length"]
    assert line["total_s"] >= line["ttft_s"] >= 0.01  # the first token took one fake step


async def test_errors_carry_the_id_and_are_logged(qwen_tokenizer, request_log):
    engine = FakeEngine(qwen_tokenizer)

    def broken_submit(*args, **kwargs):
        raise RuntimeError("a bug, not bad input")

    async with asgi_client(engine, api_key="k", max_body_bytes=1024) as client:
        auth = {"authorization": "Bearer k"}
        unauthorized = await client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "e-401"})
        too_big = await client.post("/v1/completions", content=b"{" + b" " * 2048 + b"}",
                                    headers={**auth, "x-request-id": "e-413"})
        bad = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1},
                                headers={**auth, "x-request-id": "e-400"})
        missing = await client.get("/nowhere", headers={**auth, "x-request-id": "e-404"})
        engine.submit = broken_submit
        crashed = await client.post("/v1/completions", json={"prompt": "x"}, headers={**auth, "x-request-id": "e-500"})
        health = await client.get("/health", headers={"x-request-id": "probe"})
    expected = {"e-401": (unauthorized, 401, "/v1/completions"), "e-413": (too_big, 413, "/v1/completions"),
                "e-400": (bad, 400, "/v1/completions"), "e-404": (missing, 404, "unmatched"),
                "e-500": (crashed, 500, "/v1/completions")}
    lines = request_log()
    for request_id, (response, status, endpoint) in expected.items():
        assert response.status_code == status
        assert response.headers["x-request-id"] == request_id
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        line = only_line(lines, request_id)
        assert (line["status"], line["endpoint"]) == (status, endpoint)
        assert line["prompt_tokens"] is None and line["finish_reasons"] == []  # nothing reached the engine
    assert health.headers["x-request-id"] == "probe"
    assert not [line for line in lines if line["request_id"] == "probe"]  # probes are not logged


async def test_fresh_id_when_none_or_a_bad_one_is_given(fake_engine, request_log):
    async with asgi_client(fake_engine) as client:
        plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        odd = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                headers={"x-request-id": "spaces are not allowed"})
    ids = {plain.headers["x-request-id"], odd.headers["x-request-id"]}
    assert len(ids) == 2 and "spaces are not allowed" not in ids
    assert {line["request_id"] for line in request_log()} == ids


async def test_cors_is_off_by_default_and_exposes_the_id_when_on(fake_engine):
    origin = "https://ui.example"
    async with asgi_client(fake_engine) as client:
        closed = await client.get("/v1/models", headers={"origin": origin})
    async with asgi_client(fake_engine, cors_allow_origins=(origin,)) as client:
        opened = await client.get("/v1/models", headers={"origin": origin, "x-request-id": "cors-1"})
    assert closed.status_code == 200 and "access-control-allow-origin" not in closed.headers
    assert opened.headers["access-control-allow-origin"] == origin
    assert "x-request-id" in opened.headers["access-control-expose-headers"].lower()
    assert opened.headers["x-request-id"] == "cors-1"
