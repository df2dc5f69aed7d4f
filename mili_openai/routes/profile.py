"""`POST /start_profile` and `POST /stop_profile`: a torch profile of the engine's steps while it serves, as
vLLM's routes of those names (engine/step_profiler.py records it).

They work only with `--torch-profiler-dir DIR`; without it both answer 404 in OpenAI's error shape (vLLM does
not mount them then), saying how to turn profiling on. A start while a profile runs, or a stop while none
does, is a 409. Stopping answers once the trace and the summary are written, with their paths. Requests in
flight keep streaming throughout; they run slower while the profile records.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.outputs import ProfilerStateError
from mili_openai.protocol.errors import APIError
from mili_openai.server.errors import json_response
from mili_openai.server.state import ServerState, server_state

PROFILER_CONFLICT = 409


def _profiler_dir(server: ServerState) -> str:
    profiler_dir = server.config.engine.torch_profiler_dir
    if profiler_dir is None:
        raise APIError(404, "profiling is off: start the server with --torch-profiler-dir DIR to enable "
                            "POST /start_profile and POST /stop_profile", code="profiler_disabled")
    return profiler_dir


async def start_profile(request: Request) -> Response:
    server = server_state(request)
    profiler_dir = _profiler_dir(server)
    try:
        await server.require_engine().start_profile()
    except ProfilerStateError as exc:
        raise APIError(PROFILER_CONFLICT, str(exc), code="profile_already_running") from None
    return json_response({"status": "profiling", "torch_profiler_dir": profiler_dir})


async def stop_profile(request: Request) -> Response:
    server = server_state(request)
    _profiler_dir(server)
    try:
        files = await server.require_engine().stop_profile()
    except ProfilerStateError as exc:
        raise APIError(PROFILER_CONFLICT, str(exc), code="profile_not_running") from None
    return json_response({"status": "stopped", **dataclasses.asdict(files)})


def routes() -> list[Route]:
    return [
        Route("/start_profile", start_profile, methods=["POST"]),
        Route("/stop_profile", stop_profile, methods=["POST"]),
    ]
