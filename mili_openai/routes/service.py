"""The routes around generation: /health, /version, /v1/models, /tokenize, /detokenize (vLLM shapes),
and GET /debug/engine.

/debug/engine shows the engine's stats and page accounting, for soak tests and leak hunts. It is
mounted only with `--debug-endpoints` (it walks the whole radix tree, and its numbers are internals no
client should depend on), and answers while draining too, so a test can check pages after load.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai import __version__
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.prompts import check_token_ids, encode_text
from mili_openai.routes.pooling import served_endpoints
from mili_openai.server.errors import json_response, parse_body
from mili_openai.server.state import DEFAULT_MODEL_TOKENIZER, server_state

OWNED_BY = "mili-openai"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


async def health(request: Request) -> Response:
    server = server_state(request)
    if server.is_ready():
        return json_response({"status": "ok"})
    status = "draining" if server.draining else ("failed" if server.load_error else "loading")
    return json_response({"status": status}, status_code=503)


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


async def list_models(request: Request) -> Response:
    server = server_state(request)
    engine = server.require_engine()
    model = {
        "id": server.served_model_name,
        "object": "model",
        "created": int(server.start_time),
        "owned_by": OWNED_BY,
        "root": str(engine.info.model_path),
        "parent": None,
        # the tokenizer to count tokens with (the embedded model's random weights come with Qwen3's real one)
        "tokenizer": DEFAULT_MODEL_TOKENIZER if server.config.engine.model is None else str(engine.info.model_path),
        "max_model_len": engine.info.max_model_len,
        "quantization": engine.info.quantization,  # null, or what the weights are (int8, int4, awq, ...)
        # what the model does: "generate", or a pooling model's "embed", "rerank" or "classify"
        "task": engine.info.pooling.task if engine.info.pooling is not None else "generate",
    }
    pooling = engine.info.pooling
    if pooling is not None:  # its vectors' size (a classifier's: its labels), and the endpoints it answers
        model["pooling"] = {"type": pooling.pooling_type, "normalize": pooling.normalize,
                            "dimensions": pooling.output_size, "endpoints": served_endpoints(pooling)}
        if pooling.labels:
            model["pooling"]["labels"] = list(pooling.labels)
    # each LoRA adapter as its own model, its parent the base (as vLLM lists them)
    adapters = [{"id": name, "object": "model", "created": model["created"], "owned_by": OWNED_BY, "root": path,
                 "parent": server.served_model_name, "max_model_len": engine.info.max_model_len}
                for name, path in engine.lora_adapters()]
    return json_response({"object": "list", "data": [model, *adapters]})


async def render_messages(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    try:
        return await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # a template error is the messages' fault (missing role, bad content)
        raise APIError(400, f"cannot apply the chat template to these messages: {exc}", param="messages") from None


async def tokenize(request: Request) -> Response:
    server = server_state(request)
    body = await parse_body(request, TokenizeRequest)
    server.check_model(body.model)
    engine = server.require_engine()
    if body.messages is not None:
        text = await render_messages(engine.info.tokenizer, body.messages, body.add_generation_prompt)
        add_special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special = body.add_special_tokens is not False
    tokens = await encode_text(engine.info.tokenizer, text, add_special_tokens=add_special)
    return json_response({"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    server = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    server.check_model(body.model)
    engine = server.require_engine()
    check_token_ids(body.tokens, engine.info.vocab_size, param="tokens")
    return json_response({"prompt": engine.info.tokenizer.decode(body.tokens, skip_special_tokens=False)})


def routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]


async def engine_debug(request: Request) -> Response:
    server = server_state(request)
    engine = server.engine
    if engine is None:
        raise APIError(503, "the model is not loaded", type="service_unavailable")
    return json_response({
        "stats": dataclasses.asdict(engine.stats()),
        "pages": dataclasses.asdict(await engine.page_accounting()),
        "server": {"active_requests": server.active_requests, "pending_sequences": server.pending_sequences,
                   "draining": server.draining},
    })


def debug_routes() -> list[Route]:
    return [Route("/debug/engine", engine_debug, methods=["GET"])]
