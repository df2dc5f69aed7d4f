"""Overload: a bounded waiting room. Past `max_queue` waiting sequences, new generation requests get
429 with Retry-After (OpenAI's error shape) and are counted; admitted requests are still served."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from helpers_server import REAL_ENGINE_CONFIG, TEST_MODEL_NAME, live_server
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app
from mili_openai.protocol.errors import APIError
from mili_openai.server.request_log import CURRENT_REQUEST, RequestContext
from mili_openai.server.state import QUEUE_FULL_RETRY_AFTER_S, ServerState

NUM_CONCURRENT = 6
MAX_TOKENS = 64  # long enough that the first request still runs while the others arrive
POLL_S = 0.01
SETTLE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def one_seq_engine(tiny_checkpoint):
    config = {**REAL_ENGINE_CONFIG, "max_num_seqs": 1}
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **config))


def serve(engine, max_queue: int):
    app = create_app(ServerConfig(served_model_name=TEST_MODEL_NAME, max_queue=max_queue, request_timeout_s=60.0),
                     engine=engine)
    return live_server(app)


def body(prompt: str, **extra) -> dict:
    return {"model": TEST_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}


def assert_queue_full(response: httpx.Response) -> None:
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) == QUEUE_FULL_RETRY_AFTER_S
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
    assert response.headers["x-request-id"]


def rejected_count(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith('mili_rejected_requests_total{reason="queue_full"}'):
            return float(line.split()[-1])
    return 0.0


def test_concurrent_burst_gets_429_while_admitted_requests_complete(one_seq_engine):
    async def burst(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            posts = [client.post("/v1/completions", json=body(f"burst {i}", stream=i % 2 == 1))
                     for i in range(NUM_CONCURRENT)]
            return await asyncio.gather(*posts)

    with serve(one_seq_engine, max_queue=1) as server:
        responses = asyncio.run(burst(server.base_url))
        served = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert served and refused
        for response in refused:
            assert_queue_full(response)
        for response in served:
            if response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason":"length"' in response.text
            else:
                assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert rejected_count(server.base_url) == len(refused)
        stats = one_seq_engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0


def test_n_samples_count_as_n_waiting_sequences(one_seq_engine):
    """n=3 on a one-sequence engine leaves 2 waiting: with max_queue=2 the queue is full."""
    with serve(one_seq_engine, max_queue=2) as server:
        with httpx.stream("POST", server.base_url + "/v1/completions",
                          json=body("three samples", n=3, stream=True), timeout=60) as stream:
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while one_seq_engine.stats().num_waiting < 2:
                assert time.monotonic() < deadline, "the n=3 request never queued two sequences"
                time.sleep(POLL_S)
            assert_queue_full(httpx.post(server.base_url + "/v1/completions", json=body("one more"), timeout=60))
            assert_queue_full(httpx.post(server.base_url + "/generate", json={"prompt": "x"}, timeout=60))
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and sum('"finish_reason":"length"' in e for e in events) == 3
        # drained: the same request is admitted again
        assert httpx.post(server.base_url + "/v1/completions", json=body("after", max_tokens=2)).status_code == 200


class IdleEngine:
    def is_ready(self) -> bool:
        return True

    def stats(self):
        return SimpleNamespace(num_waiting=0)


def test_admitted_but_unsubmitted_requests_hold_their_place():
    """Requests still tokenizing count toward the queue, n sequences each, until they submit."""
    server = ServerState(ServerConfig(max_queue=3), "m", engine=IdleEngine())
    first, second = RequestContext("a", "POST", "/v1/completions", server), RequestContext("b", "POST", "/x", server)
    token = CURRENT_REQUEST.set(first)
    try:
        server.check_queue(3)  # n=3 on an empty queue: admitted
        assert server.pending_sequences == 3
        CURRENT_REQUEST.set(second)
        with pytest.raises(APIError) as refused:
            server.check_queue(1)
        assert refused.value.status_code == 429 and refused.value.headers["Retry-After"]
        first.note_submitted(5, ["a"], 3)  # now the engine's waiting list counts them
        assert server.pending_sequences == 0
        server.check_queue(1)
        second.release()
        second.release()  # idempotent
        assert server.pending_sequences == 0
    finally:
        CURRENT_REQUEST.reset(token)
