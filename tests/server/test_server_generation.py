"""The generation routes' shared path (routes/job.py): all-or-nothing submits and engine errors; the SSE
encoder's error and [DONE] handling."""

from __future__ import annotations

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from helpers_server import FakeEngine, asgi_client, sse_data
from mili_openai.protocol.errors import APIError
from mili_openai.server.sse import event_bytes, sse_stream

pytestmark = pytest.mark.anyio


async def test_a_failed_submit_aborts_the_prompts_already_submitted(qwen_tokenizer):
    """A request's prompts are submitted all or nothing: the second prompt's refusal frees the first's."""
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.01)
    original_submit = engine.submit

    async def submit(request, request_id=None):
        if request_id.endswith("-1"):
            raise ValueError("refused")
        return await original_submit(request, request_id)

    engine.submit = submit
    async with asgi_client(engine) as client:
        response = await client.post("/v1/completions", json={"prompt": [[1, 2], [3, 4]], "n": 3, "max_tokens": 50})
    assert response.status_code == 400 and "refused" in response.json()["error"]["message"]
    assert len(engine.submitted) == 1 and not engine.tasks and not engine.requests


async def test_engine_error_is_a_500_on_every_generation_route(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, fail_with="engine error: oom")
    async with asgi_client(engine) as client:
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/generate", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            response = await client.post(path, json={**body, "max_tokens": 3})
            assert response.status_code == 500, path
            assert response.json()["error"]["type"] == "internal_error"


async def sse_body(events, on_disconnect=None) -> list[str]:
    async def endpoint(request):
        return sse_stream(events(), on_disconnect)

    app = Starlette(routes=[Route("/s", endpoint)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        response = await client.get("/s")
    return sse_data(response.text)


async def test_sse_encodes_events_then_done():
    async def events():
        yield {"a": 1}
        yield {"b": "ü"}

    assert await sse_body(events) == ['{"a":1}', '{"b":"ü"}', "[DONE]"]


def test_an_event_is_one_data_line_and_a_name_one_event_line():
    """The wire bytes exactly: a line break inside the data is escaped by JSON, one in a name is dropped."""
    assert event_bytes({"text": "a\nb"}) == b'data: {"text":"a\\nb"}\n\n'
    assert event_bytes({"type": "x"}, "response.output_text.delta\r\n") == (
        b'event: response.output_text.delta\ndata: {"type":"x"}\n\n')


async def test_sse_error_mid_stream_becomes_error_event_then_done():
    async def events():
        yield {"a": 1}
        raise RuntimeError("kaboom")

    data = await sse_body(events)
    assert data[0] == '{"a":1}' and data[-1] == "[DONE]"
    error = orjson.loads(data[1])["error"]
    assert error["type"] == "internal_error" and "kaboom" not in error["message"]  # no internals leaked


async def test_sse_api_error_keeps_its_message():
    async def events():
        raise APIError(400, "bad thing", param="x")
        yield {}

    data = await sse_body(events)
    assert orjson.loads(data[0])["error"] == {"message": "bad thing", "type": "invalid_request_error",
                                              "param": "x", "code": None}


async def test_shutdown_lets_streams_end_with_abort_and_done(qwen_tokenizer, monkeypatch):
    import asyncio

    from sse_starlette.sse import AppStatus

    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.02)
    # sse-starlette's process-wide shutdown flag, set as uvicorn's signal handler sets it; monkeypatch
    # saves it now (unset) and restores that at teardown, so later tests' streams are not told to stop
    monkeypatch.setattr(AppStatus, "should_exit", False)
    async with asgi_client(engine, shutdown_grace_s=0.2) as client:
        asyncio.get_running_loop().call_later(0.1, setattr, AppStatus, "should_exit", True)
        response = await client.post("/v1/completions", json={"prompt": "long", "max_tokens": 200, "stream": True})
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    last = orjson.loads(data[-2])
    assert last["choices"][0]["finish_reason"] == "abort"  # ended visibly, not cut
    assert not engine.tasks
