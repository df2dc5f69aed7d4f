"""/generate + /status, /tokenize, /detokenize, /v1/models, /health, /version against a scripted engine."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from helpers_server import TEST_MODEL_NAME, FakeEngine, asgi_client, sse_data
from mili_openai import __version__
from mili_openai.server.state import RequestRecords

pytestmark = pytest.mark.anyio


async def test_generate_then_status(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/generate", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
                                     headers={"x-request-id": "gen-1"})
        status = await client.get("/status/gen-1")
        unknown = await client.get("/status/nope")
    body = response.json()
    assert set(body) == {"request_id", "text", "token_ids", "finish_reason", "stop_reason", "logprobs", "usage"}
    assert body["request_id"] == "gen-1" and len(body["token_ids"]) == 4 and body["finish_reason"] == "length"
    assert body["text"] == fake_engine.info.tokenizer.decode(body["token_ids"])
    record = status.json()
    assert record["state"] == "finished" and record["token_ids"] == body["token_ids"]
    assert record["timings"]["time_to_first_token_s"] >= 0
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "request_not_found"


async def test_generate_stream_and_running_status(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.02)
    async with asgi_client(engine) as client:
        task = asyncio.create_task(client.post("/generate", json={"prompt": [1, 2, 3], "max_tokens": 10,
                                                                  "stream": True}, headers={"x-request-id": "s1"}))
        states = set()
        while not task.done():
            states.add((await client.get("/status/s1")).json().get("state"))
            await asyncio.sleep(0.01)
        response = task.result()
        final = (await client.get("/status/s1")).json()
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    parsed = [orjson.loads(e) for e in events[:-1]]
    assert parsed[-1]["usage"]["completion_tokens"] == 10 and parsed[-1]["usage"]["prompt_tokens"] == 3
    assert sum(len(e["token_ids"]) for e in parsed[:-1]) == 10
    assert [e["finish_reason"] for e in parsed[:-1]].count("length") == 1
    assert "running" in states and final["state"] == "finished"


async def test_generate_rejects_n(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/generate", json={"prompt": "x", "n": 2})
    assert response.status_code == 400


def test_records_are_bounded():
    records = RequestRecords(max_finished=3)
    for index in range(5):
        records.close(records.start(f"r{index}", 1))
    assert len(records) == 3 and records.get("r0") is None and records.get("r4").state == "aborted"


async def test_tokenize_detokenize_roundtrip(fake_engine):
    async with asgi_client(fake_engine) as client:
        tokenized = (await client.post("/tokenize", json={"model": TEST_MODEL_NAME, "prompt": "Hello world"})).json()
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
        text = (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).json()
        both = await client.post("/tokenize", json={"prompt": "a", "messages": []})
        out_of_vocab = await client.post("/detokenize", json={"tokens": [10**9]})
    assert tokenized == {"count": 2, "max_model_len": 256, "tokens": fake_engine.info.tokenizer.encode("Hello world")}
    assert text == {"prompt": "Hello world"}
    rendered = fake_engine.info.tokenizer.decode(chat["tokens"])
    assert "<|im_start|>user\nHi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert both.status_code == 400 and out_of_vocab.status_code == 400


async def test_models_health_version(fake_engine):
    async with asgi_client(fake_engine) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        version = (await client.get("/version")).json()
    assert models["object"] == "list"
    [model] = models["data"]
    assert model["id"] == TEST_MODEL_NAME and model["max_model_len"] == 256 and model["owned_by"]
    assert health.status_code == 200 and version == {"version": __version__}


async def test_health_is_503_while_loading_and_draining(monkeypatch):
    from mili_openai.config import ServerConfig
    from mili_openai.server import app as app_module

    loaded = asyncio.Event()

    async def slow_load(server):
        await loaded.wait()

    monkeypatch.setattr(app_module, "load_engine", slow_load)
    app = app_module.create_app(ServerConfig())
    import httpx

    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            loading = await client.get("/health")
            completion = await client.post("/v1/completions", json={"prompt": "x"})
            assert loading.status_code == 503 and loading.json()["status"] == "loading"
            assert completion.status_code == 503
            app.state.server.draining = True
            assert (await client.get("/health")).json()["status"] == "draining"
