"""POST /score (and /v1/score): vLLM's pair scores; POST /rerank, /v1/rerank and /v2/rerank: the Jina/Cohere
rerank shape (protocol/scoring.py).

A reranker model, or a sequence classifier of one label (a converted Qwen3-Reranker), scores each (query, document)
pair rendered in its prompt: one engine request per pair, all in the same steps. An embedding model embeds every
distinct text once and scores a pair by the cosine of its two embeddings. A classifier of several labels gives no
single score: /classify serves it.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.pooling_spec import CLASSIFY, QWEN3_RERANK_TEMPLATE, cosine, render_pair
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.scoring import (
    RerankRequest,
    ScoreRequest,
    ScoringFields,
    rerank_response,
    score_response,
)
from mili_openai.routes.pooling import pool_prompts, text_token_ids
from mili_openai.server.errors import json_response, parse_body
from mili_openai.server.metrics import RERANK_API, SCORE_API
from mili_openai.server.state import ServerState, request_id_of, server_state


async def score_pairs(request: Request, server: ServerState, body: ScoringFields, pairs: list[tuple[str, str]],
                      field: str, api: str) -> tuple[list[float], int]:
    """(each pair's score, the prompt tokens run). `api`: the endpoint, for the metrics."""
    info = server.require_engine().info
    if info.pooling is None:
        raise APIError(400, "this server runs a generative model; scores need a reranker or an embedding model "
                            "(mili serve CKPT --runner pooling)", param="model")
    truncate_to = body.truncation(info.max_model_len)
    if info.pooling.task == CLASSIFY and not info.pooling.scores_pairs:
        raise APIError(400, f"this server runs a classifier of {len(info.pooling.labels)} labels: a pair has no single "
                            "score; use /classify", param="model")
    if info.pooling.scores_pairs:
        template = server.config.rerank_template or QWEN3_RERANK_TEMPLATE
        texts = [render_pair(template, query, document, body.instruction) for query, document in pairs]
        # the template writes every special token itself, as the model card's prompt does
        prompts = await text_token_ids(info.tokenizer, texts, add_special_tokens=False)
        pooled = await pool_prompts(request, server, prompts, "score", field, truncate_to, api)
        return [vector[0] for vector in pooled.vectors], pooled.num_prompt_tokens
    distinct = list(dict.fromkeys(text for pair in pairs for text in pair))
    prompts = await text_token_ids(info.tokenizer, distinct)
    pooled = await pool_prompts(request, server, prompts, "score", field, truncate_to, api)
    vectors = dict(zip(distinct, pooled.vectors))
    return [cosine(vectors[first], vectors[second]) for first, second in pairs], pooled.num_prompt_tokens


async def create_score(request: Request) -> Response:
    server = server_state(request)
    body = await parse_body(request, ScoreRequest)
    server.check_model(body.model)
    scores, tokens = await score_pairs(request, server, body, body.pairs(), "text_2", SCORE_API)
    return json_response(score_response(f"score-{request_id_of(request)}", int(time.time()),
                                        server.served_model_name, scores, tokens))


async def create_rerank(request: Request) -> Response:
    server = server_state(request)
    body = await parse_body(request, RerankRequest)
    server.check_model(body.model)
    pairs = [(body.query, document) for document in body.documents]
    scores, tokens = await score_pairs(request, server, body, pairs, "documents", RERANK_API)
    response: dict[str, Any] = rerank_response(f"rerank-{request_id_of(request)}", server.served_model_name, body,
                                               scores, tokens)
    return json_response(response)


def routes() -> list[Route]:
    return [Route(path, create_score, methods=["POST"]) for path in ("/score", "/v1/score")] + [
        Route(path, create_rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
