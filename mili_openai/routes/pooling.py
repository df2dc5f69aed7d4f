"""What the pooling endpoints share (routes/embeddings.py, routes/scoring.py, routes/classification.py): the
served model checked against what the endpoint needs, their prompts checked and submitted to the engine as pooling
requests, and their vectors awaited.

Every prompt is checked (`check_pooling_request`) before any is submitted, so a bad input is a plain 400. Past
the server's request timeout, or when the client goes away, what still runs is aborted and its pages return to
the pool. Each input is its own engine request, so the scheduler batches the inputs of one request (and of
concurrent ones) into the same steps under its token budget.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from mili_openai.engine.client import RequestStream
from mili_openai.engine.contract import EngineInfo, check_pooling_request
from mili_openai.engine.pooling_spec import CLASSIFY, EMBED, RERANK, PoolingSpec
from mili_openai.protocol.embeddings import PoolingFields
from mili_openai.protocol.errors import INTERNAL_ERROR, APIError
from mili_openai.protocol.prompts import encode_text
from mili_openai.server.errors import cancel_on_disconnect, parse_body
from mili_openai.server.request_log import RequestTally, current_request
from mili_openai.server.state import ServerState, request_id_of, server_state

EMBEDDINGS_PATH, SCORE_PATH, RERANK_PATH, CLASSIFY_PATH = "/v1/embeddings", "/score", "/v1/rerank", "/classify"
MODEL_KINDS = {EMBED: "an embedding model", RERANK: "a reranker", CLASSIFY: "a sequence classifier"}
Body = TypeVar("Body", bound=PoolingFields)


def served_endpoints(spec: PoolingSpec) -> list[str]:
    """The endpoints a pooling model answers (for /v1/models): an embedding model embeds and scores pairs by cosine,
    a reranker scores pairs, a classifier classifies, and with one label scores pairs too."""
    endpoints = [EMBEDDINGS_PATH] if spec.task == EMBED else []
    endpoints += [CLASSIFY_PATH] if spec.task == CLASSIFY else []
    return endpoints + ([SCORE_PATH, RERANK_PATH] if spec.task == EMBED or spec.scores_pairs else [])


async def parse_pooling_request(request: Request, body_type: type[Body], task: str,
                                needs: str) -> tuple[ServerState, Body, EngineInfo]:
    """The request's body, and the server's engine, whose pooling model must do `task`: else a 400 that says what
    the server runs, the endpoints it answers, and what the endpoint `needs`."""
    server = server_state(request)
    body = await parse_body(request, body_type)
    server.check_model(body.model)
    info = server.require_engine().info
    if info.pooling is None or info.pooling.task != task:
        runs = "a generative model" if info.pooling is None else (
            f"{MODEL_KINDS[info.pooling.task]} (it answers {', '.join(served_endpoints(info.pooling))})")
        raise APIError(400, f"this server runs {runs}; {needs}", param="model")
    return server, body, info


@dataclass(frozen=True, slots=True)
class PooledPrompts:
    vectors: list[list[float]]  # per prompt, in order: the engine's vector (engine/pooling_spec.py)
    num_prompt_tokens: int  # every prompt's tokens, after any truncation


async def text_token_ids(tokenizer, texts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
    """Each input as token ids (text tokenised; token ids as given, checked by the engine's contract)."""
    return [await encode_text(tokenizer, text, add_special_tokens=add_special_tokens) if isinstance(text, str)
            else list(text) for text in texts]


async def pool_prompts(request: Request, server: ServerState, prompts: list[list[int]], id_prefix: str,
                       prompt_field: str, truncate_to: int | None, api: str) -> PooledPrompts:
    """Run every prompt as a pooling request and return their vectors. `api`: the metrics' label of the endpoint
    (server/metrics.py's POOLING_APIS)."""
    engine = server.require_engine()
    checked = [check_pooling_request(prompt, engine.info, prompt_field, truncate_to) for prompt in prompts]
    server.check_queue(len(checked))
    context = current_request()
    tally = context.tally if context is not None else RequestTally()
    base_id = f"{id_prefix}-{request_id_of(request)}"
    streams: list[RequestStream] = []
    timer = asyncio.get_running_loop().call_later(server.config.request_timeout_s,
                                                  lambda: [stream.abort() for stream in streams])
    try:
        for index, engine_request in enumerate(checked):
            streams.append(await engine.submit(engine_request, f"{base_id}-{index}"))
        num_tokens = sum(len(engine_request.prompt_token_ids) for engine_request in checked)
        request_ids = [stream.request_id for stream in streams]
        (context or tally).note_submitted(num_tokens, request_ids, 1)
        if server.metrics is not None:
            server.metrics.on_pooling_request(api, len(checked), num_tokens)
        waiting = asyncio.gather(*(_vector(stream, tally) for stream in streams))
        vectors = await cancel_on_disconnect(request, waiting)
    finally:
        timer.cancel()
        for stream in streams:
            stream.abort()  # a no-op for finished ones; frees the rest after an error or a disconnect
    return PooledPrompts(list(vectors), num_tokens)


async def _vector(stream: RequestStream, tally: RequestTally) -> list[float]:
    pooled = None
    async for delta in stream:
        if delta.error is not None:
            raise APIError(500, delta.error, type=INTERNAL_ERROR)
        tally.observe(delta)
        if delta.pooled is not None:
            pooled = delta.pooled
    if pooled is None:
        raise APIError(503, "the request was aborted before it finished (timeout or shutdown)",
                       type="service_unavailable")
    return pooled
