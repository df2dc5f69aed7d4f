"""The Starlette app: routes, middleware, error handlers, and the lifespan that owns the engine.

When no engine is given, the lifespan loads the model on a worker thread *after* the server starts
listening, so /health answers 503 while it loads (Kubernetes keeps the pod out of rotation instead
of restarting it): on this event loop, or in an engine process of its own (`engine_process`, the default
on CUDA; engine/process_client.py). On shutdown, /health turns 503 first, then the engine stops (the
`mili serve` drain in server/drain.py lets in-flight requests finish in between), and an engine the
lifespan built is closed (its process exits).

Middleware, outermost first: request id / context / HTTP metrics / request log, the catch-all 500,
CORS (only with --cors-allow-origin), the API key and body limit; then Starlette's exception handlers.
The request-id middleware sits outside everything that can answer, so every response carries the id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Route

from mili_openai.config import ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.client import EngineClient
from mili_openai.engine.process_client import EngineProcessClient
from mili_openai.engine.process_helpers import freeze_heap
from mili_openai.engine.step_forward import resolve_device
from mili_openai.engine.sampling_defaults import describe_sampling_defaults
from mili_openai.routes import (
    chat,
    classification,
    completions,
    embeddings,
    generate,
    lora,
    profile,
    responses,
    scoring,
    service,
)
from mili_openai.server.errors import CatchAllMiddleware, install_error_handlers
from mili_openai.server.metrics import ServerMetrics
from mili_openai.server.middleware import REQUEST_ID_HEADER, AccessGuardMiddleware, RequestContextMiddleware
from mili_openai.server.state import ServerState, default_served_name

logger = logging.getLogger(__name__)


def all_routes(config: ServerConfig, metrics: ServerMetrics) -> list[BaseRoute]:
    routes: list[BaseRoute] = [*service.routes(), *chat.routes(), *responses.routes(), *completions.routes(),
                               *generate.routes(), *profile.routes(), *embeddings.routes(), *scoring.routes(),
                               *classification.routes(),
                               *lora.routes(),
                               Route("/metrics", metrics.endpoint, methods=["GET"])]
    if config.debug_endpoints:
        routes.extend(service.debug_routes())
    return routes


def build_engine(config: ServerConfig, observer: ServerMetrics | None) -> EngineClient:
    """The engine, loaded (blocking: seconds): in a process of its own where the device's default or
    --engine-process asks for it, else on this process's event loop."""
    engine_config = config.engine
    if engine_config.for_device(resolve_device(engine_config.device).type).engine_process:
        return EngineProcessClient(engine_config, observer, freeze_gc_after_load=config.freeze_gc_after_load)
    return AsyncEngine(engine_config, observer)


async def load_engine(server: ServerState) -> None:
    """Build the engine on a thread (seconds of blocking work), then start its loop."""
    logger.info("loading the model (/health says loading until it is served)")
    engine: EngineClient | None = None
    try:
        engine = await asyncio.to_thread(build_engine, server.config, server.metrics)
        await engine.start()
    except Exception as exc:
        logger.exception("the model failed to load")
        server.load_error = f"{type(exc).__name__}: {exc}"
        if engine is not None:
            await engine.close()
        return
    if server.config.freeze_gc_after_load:
        freeze_heap()  # before the first request: the collection in it holds the GIL a while
    server.engine = engine
    info = engine.info
    logger.info("model %s loaded from %s; serving (max_model_len %d, %s)", server.served_model_name,
                info.model_path, info.max_model_len,
                f"quantization {info.quantization}" if info.quantization else "unquantized")
    logger.info(describe_sampling_defaults(info.sampling_defaults))
    engine_config = server.config.engine
    speculative = engine_config.for_device(resolve_device(engine_config.device).type).speculative_config
    if speculative is not None:
        limit = speculative.disable_by_batch_size
        source = {"ngram": f"n-grams of {speculative.prompt_lookup_min}-{speculative.prompt_lookup_max} tokens",
                  "mtp": "the checkpoint's MTP module"}.get(speculative.method, f"the draft model {speculative.model}")
        logger.info("speculative decoding: %s, up to %d draft tokens from %s%s; a request pauses drafting below %.0f%% "
                    "acceptance", speculative.method, speculative.num_speculative_tokens, source,
                    f", off above {limit} running sequences" if limit else "", 100 * speculative.min_acceptance_rate)


def create_app(config: ServerConfig, engine: EngineClient | None = None) -> Starlette:
    """The app for `config`. Pass `engine` (started or not) to skip loading one."""
    server = ServerState(config, default_served_name(config), start_time=time.time())
    server.metrics = ServerMetrics(lambda: server.engine.stats() if server.engine is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        server.draining = server.grace_expired = False
        loader: asyncio.Task | None = None
        if engine is None:
            loader = asyncio.create_task(load_engine(server), name="mili-load-engine")
        else:
            engine.set_observer(server.metrics)  # built before the app: attach this app's metrics
            await engine.start()
            server.engine = engine
        try:
            yield {"server": server}
        finally:
            server.draining = True
            if loader is not None:
                loader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loader
            if server.engine is not None:
                await server.engine.shutdown()
            if engine is None:  # the lifespan built it: it goes with the app
                if server.engine is not None:
                    await server.engine.close()
                server.engine = None

    middleware = [Middleware(RequestContextMiddleware, server=server), Middleware(CatchAllMiddleware)]
    if config.cors_allow_origins:
        # before the access guard, so preflight requests are answered without an API key
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(config.cors_allow_origins), allow_methods=["*"],
            allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER],
        ))
    middleware.append(Middleware(AccessGuardMiddleware, server=server))
    app = Starlette(routes=all_routes(config, server.metrics), middleware=middleware, lifespan=lifespan)
    install_error_handlers(app)
    app.state.server = server  # reachable outside requests: the CLI marks the server draining on SIGTERM
    return app
