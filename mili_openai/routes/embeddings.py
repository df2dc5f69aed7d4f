"""POST /v1/embeddings: OpenAI's embeddings API over a pooling model (protocol/embeddings.py)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.pooling_spec import EMBED, finish_vector
from mili_openai.protocol.embeddings import EmbeddingRequest, embedding_response, encode_vector
from mili_openai.protocol.errors import APIError
from mili_openai.routes.pooling import parse_pooling_request, pool_prompts, text_token_ids
from mili_openai.server.errors import json_response
from mili_openai.server.metrics import EMBEDDINGS_API
from mili_openai.server.state import request_id_of

INPUT_FIELD = "input"


async def create_embedding(request: Request) -> Response:
    server, body, info = await parse_pooling_request(
        request, EmbeddingRequest, EMBED, "embeddings need an embedding model (mili serve CKPT --runner pooling)")
    if body.dimensions is not None and body.dimensions > info.pooling.hidden_size:
        raise APIError(400, f"dimensions must be at most {info.pooling.hidden_size}, the model's embedding size",
                       param="dimensions")
    prompts = await text_token_ids(info.tokenizer, body.inputs(), body.add_special_tokens)
    pooled = await pool_prompts(request, server, prompts, "embd", INPUT_FIELD, body.truncation(info.max_model_len),
                                EMBEDDINGS_API)
    normalize = info.pooling.normalize if body.normalize is None else body.normalize
    vectors = [encode_vector(finish_vector(vector, body.dimensions, normalize), body.encoding_format)
               for vector in pooled.vectors]
    return json_response(embedding_response(f"embd-{request_id_of(request)}", int(time.time()),
                                            server.served_model_name, vectors, pooled.num_prompt_tokens))


def routes() -> list[Route]:
    return [Route("/v1/embeddings", create_embedding, methods=["POST"])]
