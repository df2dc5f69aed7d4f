"""POST /classify (and /v1/classify): vLLM's classification API over a Qwen3ForSequenceClassification checkpoint
(protocol/classification.py): each input's label probabilities from the score head at its last token."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.pooling_spec import CLASSIFY
from mili_openai.protocol.classification import ClassificationRequest, classification_response
from mili_openai.routes.pooling import parse_pooling_request, pool_prompts, text_token_ids
from mili_openai.server.errors import json_response
from mili_openai.server.metrics import CLASSIFY_API
from mili_openai.server.state import request_id_of

INPUT_FIELD = "input"


async def create_classification(request: Request) -> Response:
    server, body, info = await parse_pooling_request(
        request, ClassificationRequest, CLASSIFY,
        "/classify needs a sequence-classification checkpoint (Qwen3ForSequenceClassification, with its score head)")
    prompts = await text_token_ids(info.tokenizer, body.inputs(), body.add_special_tokens)
    pooled = await pool_prompts(request, server, prompts, "classify", INPUT_FIELD,
                                body.truncation(info.max_model_len), CLASSIFY_API)
    return json_response(classification_response(f"classify-{request_id_of(request)}", int(time.time()),
                                                  server.served_model_name, info.pooling.labels, pooled.vectors,
                                                  pooled.num_prompt_tokens))


def routes() -> list[Route]:
    return [Route(path, create_classification, methods=["POST"]) for path in ("/classify", "/v1/classify")]
