"""Fan-out of n samples and its cleanup; the SSE encoder's error and [DONE] handling."""

from __future__ import annotations

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from helpers_server import FakeEngine, qwen_tokenizer, sse_data  # noqa: F401
from mili_openai.engine.sampling_params import INT64_MAX, SamplingParams
from mili_openai.server.errors import APIError
from mili_openai.routes.job import collect_choices, generate_choices, sub_request_params
from mili_openai.server.sse import sse_stream

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def engine(qwen_tokenizer):  # noqa: F811
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.001)
    await engine.start()
    yield engine
    await engine.shutdown()


def test_sub_request_seeds_stay_in_int64():
    assert sub_request_params(SamplingParams(n=3, seed=10), 2).seed == 12
    assert sub_request_params(SamplingParams(n=3, seed=INT64_MAX), 2).seed == INT64_MAX - 2
    assert sub_request_params(SamplingParams(n=3), 1).seed is None
    assert sub_request_params(SamplingParams(n=3), 1).n == 1


async def test_collect_choices_fans_out(engine):
    results, usage = await collect_choices(engine, [1, 2, 3], SamplingParams(n=3, max_tokens=4, seed=1), "r")
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in results)
    assert [s[2] for s in engine.submitted] == ["r-0", "r-1", "r-2"]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 12, 15)


async def test_early_stop_aborts_every_sub_request(engine):
    engine.token_delay_s = 0.01
    choices = generate_choices(engine, [1, 2], SamplingParams(n=4, max_tokens=100), "early")
    index, delta = await choices.__anext__()
    assert delta.finish_reason is None
    await choices.aclose()  # the consumer went away
    assert not engine.tasks and not engine.owned


async def test_failed_submit_aborts_the_ones_already_submitted(engine):
    engine.abort_calls = []
    original_submit = engine.submit

    def submit(prompt, params, request_id=None):
        if request_id.endswith("-2"):
            raise ValueError("refused")
        return original_submit(prompt, params, request_id)

    engine.submit = submit
    with pytest.raises(ValueError, match="refused"):
        await collect_choices(engine, [1], SamplingParams(n=3, max_tokens=50), "partial")
    assert not engine.tasks


async def test_engine_error_raises_500(qwen_tokenizer):  # noqa: F811
    engine = FakeEngine(qwen_tokenizer, fail_with="engine error: oom")
    await engine.start()
    with pytest.raises(APIError) as info:
        await collect_choices(engine, [1], SamplingParams(max_tokens=3), "bad")
    assert info.value.status_code == 500


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


async def test_shutdown_lets_streams_end_with_abort_and_done(qwen_tokenizer, monkeypatch):  # noqa: F811
    import asyncio

    from sse_starlette.sse import AppStatus

    from helpers_server import asgi_client

    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.02)
    async with asgi_client(engine, shutdown_grace_s=0.2) as client:
        asyncio.get_running_loop().call_later(0.1, setattr, AppStatus, "should_exit", True)
        try:
            response = await client.post("/v1/completions", json={"prompt": "long", "max_tokens": 200,
                                                                   "stream": True})
        finally:
            monkeypatch.setattr(AppStatus, "should_exit", False)
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    last = orjson.loads(data[-2])
    assert last["choices"][0]["finish_reason"] == "abort"  # ended visibly, not cut
    assert not engine.tasks
