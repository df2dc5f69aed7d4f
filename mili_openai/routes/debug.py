"""GET /debug/engine: the engine's stats and page accounting, for soak tests and leak hunts.

Mounted only with `--debug-endpoints` (it walks the whole radix tree, and its numbers are internals
no client should depend on). It answers while draining too, so a test can check pages after load.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.server.errors import APIError
from mili_openai.server.responses import json_response
from mili_openai.server.state import server_state


async def engine_debug(request: Request) -> Response:
    server = server_state(request)
    engine = server.engine
    if engine is None:
        raise APIError(503, "the model is not loaded", type="service_unavailable")
    return json_response({
        "stats": dataclasses.asdict(engine.stats()),
        "pages": dataclasses.asdict(engine.page_accounting()),
        "server": {"active_requests": server.active_requests, "pending_sequences": server.pending_sequences,
                   "draining": server.draining},
    })


def routes() -> list[Route]:
    return [Route("/debug/engine", engine_debug, methods=["GET"])]
