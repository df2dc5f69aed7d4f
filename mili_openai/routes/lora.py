"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: LoRA adapters served from now on, or no
longer, without a restart, as vLLM's routes of those names (bodies `{"lora_name", "lora_path"}` and
`{"lora_name"}`, a plain-text "Success: ..." answer).

They work only with `--enable-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`) beside
`--enable-lora`; otherwise both answer 404 in OpenAI's error shape, saying how to turn them on (vLLM does not mount
them then). A load reads and checks the adapter before it is served: a path without a PEFT adapter, a rank over
`--max-lora-rank`, target modules this base does not have or weights shaped for another base are a 400 naming the
fault, as is a name already served. Unloading an unknown name is a 404. Requests already running on an adapter
being unloaded finish on it (as in vLLM); new ones naming it get the unknown model's 404.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from mili_openai.engine.contract import LoraAdapterExists, UnknownLoraAdapter
from mili_openai.protocol.errors import APIError
from mili_openai.server.errors import parse_body
from mili_openai.server.state import ServerState, server_state


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # vLLM's lora_int_id is ignored: names are the key here
    lora_name: str


def _check_enabled(server: ServerState) -> None:
    if not server.config.runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off: start the server with --enable-lora and "
                            "--enable-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) to enable "
                            "POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter",
                       code="runtime_lora_updating_disabled")


async def load_lora_adapter(request: Request) -> Response:
    server = server_state(request)
    _check_enabled(server)
    body = await parse_body(request, LoadLoraAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if body.lora_name == server.served_model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name: give the adapter another",
                       param="lora_name")
    try:
        await server.require_engine().load_lora_adapter(body.lora_name, body.lora_path)
    except LoraAdapterExists as exc:
        raise APIError(400, str(exc), param="lora_name", code="lora_adapter_exists") from None
    except ValueError as exc:  # the adapter read and refused (model/lora_adapter.py's AdapterError names why)
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    server = server_state(request)
    _check_enabled(server)
    body = await parse_body(request, UnloadLoraAdapterRequest)
    try:
        await server.require_engine().unload_lora_adapter(body.lora_name)
    except UnknownLoraAdapter as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_adapter_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def routes() -> list[Route]:
    return [
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    ]
