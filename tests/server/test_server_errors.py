"""Bad input answered with its status and OpenAI's error shape; auth, body limit, readiness, request ids."""

from __future__ import annotations

import httpx
import pytest

from helpers_server import TEST_MODEL_NAME, FakeEngine, asgi_client, sse_data

MODEL = TEST_MODEL_NAME
pytestmark = pytest.mark.anyio


client_for = asgi_client


def assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 129}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [-1, 2]}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "stop": 7}, 400, "stop"),
    ({"prompt": "hi", "stop": [""]}, 400, None),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"9999999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ({"prompt": "hi", "suffix": "x"}, 400, None),
    ({"prompt": "hi", "best_of": 3}, 400, None),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "max_tokens": 10_000}, 400, None),
    ({"prompt": "hi", "model": "other-model"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
async def test_bad_completion_requests(fake_engine, body, status, param):
    async with client_for(fake_engine) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, **body} if "model" not in body
                                     else body)
    error = assert_error_shape(response, status)
    assert error["param"] == param
    assert not fake_engine.tasks  # nothing left running


async def test_context_overflow_says_the_numbers(fake_engine):
    async with client_for(fake_engine) as client:
        response = await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 300})
    message = assert_error_shape(response, 400)["message"]
    assert "256" in message and "302" in message


async def test_malformed_json_and_non_object(fake_engine):
    async with client_for(fake_engine) as client:
        broken = await client.post("/v1/completions", content=b'{"prompt": ',
                                   headers={"content-type": "application/json"})
        listed = await client.post("/v1/completions", json=["prompt"])
    assert_error_shape(broken, 400)
    assert_error_shape(listed, 400)


async def test_unknown_route_and_wrong_method(fake_engine):
    async with client_for(fake_engine) as client:
        missing = await client.get("/v1/nothing")
        wrong = await client.get("/v1/completions")
    assert_error_shape(missing, 404)
    assert_error_shape(wrong, 405)


async def test_api_key_required_except_open_paths(fake_engine):
    async with client_for(fake_engine, api_key="sekrit") as client:
        denied = await client.post("/v1/completions", json={"prompt": "hi"})
        wrong = await client.get("/v1/models", headers={"authorization": "Bearer nope"})
        allowed = await client.get("/v1/models", headers={"authorization": "Bearer sekrit"})
        health = await client.get("/health")
        version = await client.get("/version")
    assert assert_error_shape(denied, 401)["type"] == "authentication_error"
    assert_error_shape(wrong, 401)
    assert allowed.status_code == 200
    assert health.status_code == 200 and version.status_code == 200


async def test_body_over_limit_is_413_by_header_and_by_stream(fake_engine):
    limit = 2048
    big = b'{"prompt": "' + b"a" * (limit * 2) + b'"}'

    async def chunked():
        for start in range(0, len(big), 512):
            yield big[start:start + 512]

    async with client_for(fake_engine, max_body_bytes=limit) as client:
        declared = await client.post("/v1/completions", content=big)
        streamed = await client.post("/v1/completions", content=chunked())
    assert_error_shape(declared, 413)
    assert_error_shape(streamed, 413)


async def test_not_ready_is_503_and_health_follows(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer)
    async with client_for(engine) as client:
        assert (await client.get("/health")).status_code == 200
        engine.started = False  # as if the engine loop had died
        assert (await client.get("/health")).status_code == 503
        error = assert_error_shape(await client.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert error["type"] == "service_unavailable"


async def test_engine_failure_is_500_not_a_hang(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, fail_with="engine error: boom")
    async with client_for(engine) as client:
        plain = await client.post("/v1/completions", json={"prompt": "hi"})
        streamed = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert assert_error_shape(plain, 500)["type"] == "internal_error"
    events = sse_data(streamed.text)
    assert events[-1] == "[DONE]"
    assert "boom" in events[-2] and '"error"' in events[-2]


async def test_request_id_is_echoed_and_used(fake_engine):
    async with client_for(fake_engine) as client:
        given = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"x-request-id": "req-42"})
        fresh = await client.post("/v1/completions", json={"prompt": "hi"})
        odd = await client.get("/health", headers={"x-request-id": "bad id\twith spaces"})
    assert given.headers["x-request-id"] == "req-42"
    assert given.json()["id"] == "cmpl-req-42"
    assert fresh.json()["id"] == f"cmpl-{fresh.headers['x-request-id']}"
    assert odd.headers["x-request-id"] != "bad id\twith spaces"


async def test_queue_full_is_429(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer)
    engine.stats = lambda: type("S", (), {"num_waiting": 5})()  # a queue already over max_queue
    async with client_for(engine, max_queue=5) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert assert_error_shape(response, 429)["type"] == "rate_limit_exceeded"


async def test_cors_preflight_passes_before_the_api_key(fake_engine):
    origin = "https://app.example"
    async with client_for(fake_engine, api_key="k", cors_allow_origins=(origin,)) as client:
        preflight = await client.options("/v1/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        other = await client.options("/v1/completions", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
    assert other.status_code == 400
