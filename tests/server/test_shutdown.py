"""Graceful shutdown: health 503 -> drain -> exit 0.

SIGTERM mid-stream to a real `mili serve` process: /health answers 503 at once, new generation requests
get 503, the in-flight stream completes normally, and the process exits 0. Past the grace (the same
`DrainingServer`, in this process, told to exit as a signal tells it), what still runs is aborted: the
stream ends with finish_reason "abort", a 503 error event and [DONE]. The tests wait on what the server
reports (its log, its engine), never on how long something takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from helpers_server import sse_data
from mili_openai.bench.server_process import free_port
from mili_openai.cli import make_server
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.server.drain import DrainingServer

MODEL = "tiny"
START_TIMEOUT_S = 120.0
POLL_S = 0.1
# Long enough that a stream is still in flight when the signal lands (the test checks it from the log).
SHORT_STREAM_TOKENS = 120
ENDLESS_STREAM_TOKENS = 4000
# The drain waits for the stream, however slow the machine: no wall-clock bound decides this test.
UNBOUNDED_GRACE_S = 3600.0
SERVE_FLAGS = ("--dtype", "float32", "--num-pages", "320", "--max-model-len", "4096", "--log-level", "info")
EXIT_TIMEOUT_S = 120.0  # a hang guard, not a deadline the drain is held to


@contextlib.contextmanager
def serve(checkpoint: Path, log_path: Path, grace_s: float) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--port", str(port),
             "--served-model-name", MODEL, "--shutdown-grace-period", str(grace_s), *SERVE_FLAGS],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base_url + "/health").status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(POLL_S)
        yield proc, base_url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stream_body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "keep going", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def test_sigterm_mid_stream_drains_then_exits_zero(tiny_checkpoint, tmp_path):
    log_path = tmp_path / "server.log"
    with serve(tiny_checkpoint, log_path, UNBOUNDED_GRACE_S) as (proc, base_url):
        with httpx.stream("POST", base_url + "/v1/completions", json=stream_body(SHORT_STREAM_TOKENS),
                          headers={"x-request-id": "drain-me"}, timeout=None) as response:
            assert response.headers["x-request-id"] == "drain-me"
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            health = httpx.get(base_url + "/health")  # a new connection: the listener stays open while draining
            refused = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "too late"})
            rest = [line for line in lines if line.startswith("data: ")]
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        events = sse_data("\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"  # completed, not cut
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    log = log_path.read_text()
    assert "Traceback" not in log
    assert f"mili-openai: serving model '{MODEL}'" in log  # the banner on stdout
    assert "draining: 1 request(s) in flight" in log  # the signal came while the stream ran
    request_lines = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    [line] = [entry for entry in request_lines if entry["request_id"] == "drain-me"]
    assert line["status"] == 200 and line["output_tokens"] == SHORT_STREAM_TOKENS
    assert line["finish_reasons"] == ["length"] and line["endpoint"] == "/v1/completions"


@contextlib.contextmanager
def draining_server(checkpoint: Path, grace_s: float) -> Iterator[tuple[DrainingServer, str]]:
    """`mili serve`'s uvicorn server (the CLI's `make_server`) on a thread of this process."""
    engine = EngineConfig(model=str(checkpoint), dtype="float32", num_pages=320, max_model_len=4096)
    config = ServerConfig(engine=engine, served_model_name=MODEL, port=free_port(), shutdown_grace_s=grace_s,
                          log_level="warning")
    server = make_server(config)

    def run() -> None:
        async def serve() -> None:
            server.test_loop = asyncio.get_running_loop()  # where the test delivers its "signal"
            await server.serve()
        asyncio.run(serve())

    thread = threading.Thread(target=run, name="draining-server")
    thread.start()
    base_url = f"http://127.0.0.1:{config.port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.state.is_ready():
            assert thread.is_alive() and time.monotonic() < deadline, "the server never became ready"
            time.sleep(POLL_S)
        yield server, base_url
    finally:
        server.should_exit = True
        thread.join(timeout=EXIT_TIMEOUT_S)


def test_past_the_grace_requests_are_aborted_visibly(tiny_checkpoint):
    grace_s = 1.0  # far shorter than the requests: they are still running when it ends
    with draining_server(tiny_checkpoint, grace_s) as (server, base_url):
        plain: dict = {}

        def post_plain() -> None:
            body = {"model": MODEL, "prompt": "never finishes", "max_tokens": ENDLESS_STREAM_TOKENS,
                    "ignore_eos": True}
            plain["response"] = httpx.post(base_url + "/v1/completions", json=body, timeout=None)

        worker = threading.Thread(target=post_plain)
        with httpx.stream("POST", base_url + "/v1/completions", json=stream_body(ENDLESS_STREAM_TOKENS),
                          timeout=None) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            worker.start()
            engine = server.state.engine
            deadline = time.monotonic() + START_TIMEOUT_S
            while engine.stats().num_running + engine.stats().num_waiting < 2:  # the plain request is in too
                assert time.monotonic() < deadline, "the plain request never reached the engine"
                time.sleep(POLL_S)
            server.test_loop.call_soon_threadsafe(server.handle_exit, signal.SIGINT, None)  # as a signal does
            rest = [line for line in lines if line.startswith("data: ")]
        worker.join(timeout=EXIT_TIMEOUT_S)
        events = sse_data("\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "server_shutdown"
        assert orjson.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
        choice = plain["response"].json()["choices"][0]
        assert plain["response"].status_code == 200 and choice["finish_reason"] == "abort"
        assert server.state.grace_expired and not server.model_failed
