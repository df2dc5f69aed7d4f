"""Issue 52: a client that goes away while its request body is still arriving (the keep-alive race's
server-side trace) is an info line and a count, never an "unhandled error", and nothing is sent back."""

from __future__ import annotations

import logging

import pytest

from mili_openai.config import ServerConfig
from mili_openai.server.app import create_app

pytestmark = pytest.mark.anyio


async def test_a_client_gone_mid_body_is_counted_and_gets_nothing(fake_engine, caplog):
    app = create_app(ServerConfig(), engine=fake_engine)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"64")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": {}}
    messages = iter([{"type": "http.request", "body": b'{"prompt": "hal', "more_body": True},
                     {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)
    assert sent == []  # the socket is closed: no 500 (nor anything else) is written to it
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert any("client disconnected while its request body" in r.getMessage() for r in caplog.records)
    metrics = app.state.server.metrics
    value = metrics.registry.get_sample_value(
        "mili_client_disconnects_total", {"path": "/v1/completions", "phase": "request_body"})
    assert value == 1


HTTPX_POOL_EXPIRY_S = 5.0  # httpx's default keepalive_expiry: the openai SDK's, LangChain's


def test_the_server_idles_out_after_common_client_pools_and_the_flag_reaches_uvicorn():
    from mili_openai.cli import build_parser, config_from_args, uvicorn_config

    default = uvicorn_config(ServerConfig(), app=None)
    assert default.timeout_keep_alive > HTTPX_POOL_EXPIRY_S  # the client's pool closes first: no race
    args = build_parser().parse_args(["serve", "--timeout-keep-alive", "620"])
    assert uvicorn_config(config_from_args(args), app=None).timeout_keep_alive == 620
    with pytest.raises(ValueError, match="timeout_keep_alive_s"):
        ServerConfig(timeout_keep_alive_s=0)
