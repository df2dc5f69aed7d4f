"""Issue 52's race, replayed on a virtual clock: a client whose connection pool keeps an idle connection for
httpx's default expiry reuses it at exactly that age. uvicorn's keep-alive timer is held by the event loop
and fired only when the test advances the clock, so the outcome never depends on scheduling luck: a server
that idles connections out no later than the client's pool does closes the socket the client is about to
write its next request into."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import uvicorn

from mili_openai.bench.server_process import free_port
from mili_openai.cli import uvicorn_config
from mili_openai.config import ServerConfig

KEEP_ALIVE_HANDLER = "timeout_keep_alive_handler"  # what uvicorn's HTTP protocols schedule on the loop
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
BODY = b"ok"
START_TIMEOUT_S = 60.0
RECV_BYTES = 65536


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """Holds every keep-alive timer instead of scheduling it; `advance(s)` fires those due within s seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[float, asyncio.TimerHandle]] = []

    def call_later(self, delay, callback, *args, context=None):
        if getattr(callback, "__name__", "") != KEEP_ALIVE_HANDLER:
            return super().call_later(delay, callback, *args, context=context)
        handle = asyncio.TimerHandle(self.time() + delay, callback, args, self, context)
        self.held.append((delay, handle))
        return handle

    def advance(self, seconds: float) -> None:
        due = [handle for delay, handle in self.held if delay <= seconds and not handle.cancelled()]
        self.held = [(delay - seconds, handle) for delay, handle in self.held if handle not in due]
        for handle in due:
            handle._run()  # what the loop itself calls when a timer is due


async def plain_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(BODY))]})
    await send({"type": "http.response.body", "body": BODY})


def read_response(connection: socket.socket) -> bytes:
    """One whole response (headers and the known body), or b"" if the server closed the connection."""
    data = b""
    while not data.endswith(BODY):
        chunk = connection.recv(RECV_BYTES)
        if not chunk:
            return b""
        data += chunk
    return data


def test_a_connection_reused_at_the_client_pools_expiry_is_still_open():
    config = uvicorn_config(ServerConfig(host="127.0.0.1", port=free_port()), plain_app)
    config.lifespan = "off"
    server = uvicorn.Server(config)
    loop = VirtualClockLoop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        async def wait_started() -> None:
            while not server.started:
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(wait_started(), loop).result(timeout=START_TIMEOUT_S)
        with socket.create_connection((config.host, config.port)) as connection:
            connection.sendall(REQUEST)
            assert read_response(connection).startswith(b"HTTP/1.1 200")

            async def idle_for_the_pool_expiry() -> None:
                loop.advance(httpx.Limits().keepalive_expiry)  # the openai SDK's, LangChain's, litellm's pools

            asyncio.run_coroutine_threadsafe(idle_for_the_pool_expiry(), loop).result(timeout=START_TIMEOUT_S)
            connection.sendall(REQUEST)  # the pool reuses the connection: it is not older than its expiry
            assert read_response(connection).startswith(b"HTTP/1.1 200"), "the server closed a connection in reuse"
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_S)
        loop.close()
