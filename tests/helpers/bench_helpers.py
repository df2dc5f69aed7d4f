"""What the `bench serve` tests share: a small ShareGPT-format file, and a fake OpenAI-compatible streaming
server with known delays, served from a thread on 127.0.0.1 (the tokenizer is conftest's `bench_tokenizer`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

FAKE_MODEL = "fake-model"
TTFT_S = 0.15  # the fake server's delay before the first token
ITL_S = 0.02  # and between tokens
FAKE_PROMPT_TOKENS = 11  # the prompt tokens its usage counts per user message
SERVER_START_TIMEOUT_S = 10.0


SHAREGPT_KEPT = [  # (prompt, reply): each side at least 4 tokens
    ("Explain how a hash map handles collisions in a few sentences.", "It keeps a list per bucket and walks it."),
    ("Write a haiku about the sea at night, please.", "Dark water whispers under a silver moon tonight."),
    ("What is the capital of France, and why is it famous?", "Paris, famous for art, food and its history."),
    ("Summarise the plot of Hamlet in two short lines.", "A prince avenges his father, and nearly all die."),
]


def write_sharegpt(path) -> None:
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
               for i, (p, r) in enumerate(SHAREGPT_KEPT)]
    entries += [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "Only a question with no reply here"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "long", "conversations": [{"from": "human", "value": " word" * 1100},
                                         {"from": "gpt", "value": "A reply long enough to count."}]},
        "not a conversation",
    ]
    path.write_text(json.dumps(entries))


# ---- a fake OpenAI-compatible streaming server with known delays ----
def fake_openai_app(fail_every: int = 0, send_usage: bool = True, first_delay_s: float = TTFT_S,
                    served: tuple[str, ...] = (FAKE_MODEL,), bodies: list | None = None) -> Starlette:
    """Streams `max_tokens` one-word chunks: the first after `first_delay_s`, the next ITL_S apart.
    Every `fail_every`-th request gets a 500 (odd ones) or an in-stream error event (even ones). Its usage counts
    FAKE_PROMPT_TOKENS per user message, all but the last's as cached. `served`: the model names it lists and
    takes; `app.state.models_asked` records each request's. `bodies` collects the request bodies."""
    counter = {"n": 0}
    models_asked: list[str] = []

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"} for name in served]})

    async def generate(request: Request):
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        counter["n"] += 1
        number = counter["n"]
        chat = request.url.path.endswith("/chat/completions")
        failing = fail_every and number % fail_every == 0
        if failing and (number // fail_every) % 2 == 1:
            return JSONResponse({"error": {"message": f"injected failure {number}"}}, status_code=500)
        assert body["stream"] is True and body["model"] in served  # the fake's own sanity check
        models_asked.append(body["model"])

        def chunk(text: str | None, usage: dict | None = None, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text or "", "finish_reason": finish})
            return "data: " + json.dumps({"choices": [] if usage else [choice], "usage": usage}) + "\n\n"

        async def events():
            await asyncio.sleep(first_delay_s)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(ITL_S)
                if failing and i == 1:
                    yield 'data: {"error": {"message": "injected stream error"}}\n\n'
                    return
                yield chunk(" word", finish="length" if i == body["max_tokens"] - 1 else None)
            if send_usage:
                users = max(1, sum(message["role"] == "user" for message in body.get("messages", ())))
                prompt = FAKE_PROMPT_TOKENS * users
                yield chunk(None, usage={"prompt_tokens": prompt, "completion_tokens": body["max_tokens"],
                                         "total_tokens": prompt + body["max_tokens"],
                                         "prompt_tokens_details": {"cached_tokens": prompt - FAKE_PROMPT_TOKENS}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                            Route("/v1/chat/completions", generate, methods=["POST"])])
    app.state.models_asked = models_asked
    return app


@contextlib.contextmanager
def serve_in_thread(app: Starlette) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(SERVER_START_TIMEOUT_S)
        sock.close()
