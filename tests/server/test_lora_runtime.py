"""LoRA adapters loaded and unloaded at run time through a real server (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, vLLM's routes) while other requests stream through the openai SDK: /v1/models follows,
a stream on an adapter being unloaded finishes with the tokens it would have had, refusals are 4xx in OpenAI's
shape naming the fault, and the routes are 404s without the flag."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine_helpers import random_prompts
from helpers_server import (
    REAL_ENGINE_CONFIG,
    REAL_SERVE_FLAGS,
    TEST_MODEL_NAME,
    asgi_client,
    live_server,
    mili_serve_process,
    sdk_client,
)
from lora_helpers import edited_adapter
from mili_openai.cli import RUNTIME_LORA_ENV, build_parser, config_from_args
from mili_openai.config import EngineConfig, LoraConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app

MAX_RANK = 16  # r64 is over it
LONG_OUTPUT = 48  # tokens of the streams that run across a load and an unload
PROMPT = random_prompts(1, [12], seed=29)[0]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
START_TIMEOUT_S = 180.0  # a `mili serve` child and its engine process import torch and load on a busy machine


@pytest.fixture(scope="module")
def live(tiny_checkpoint, lora_adapters):
    engine_config = EngineConfig(model=str(tiny_checkpoint), cpu_kernels_in_background=True, **REAL_ENGINE_CONFIG,
                                 lora=LoraConfig(modules=(("r8", str(lora_adapters["r8"])),), max_loras=2,
                                                 max_lora_rank=MAX_RANK))
    config = ServerConfig(engine=engine_config, served_model_name=TEST_MODEL_NAME, request_timeout_s=60.0,
                          runtime_lora_updating=True)
    with live_server(create_app(config, engine=AsyncEngine(engine_config))) as server:
        yield server


@pytest.fixture(scope="module")
def api_base(live):
    return live.api_base


def post(live, path: str, body: dict) -> httpx.Response:
    """POST to the server `live` (a LiveServer, or its base URL)."""
    return httpx.post(getattr(live, "base_url", live) + path, json=body, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a refused call (asserting its status)."""
    assert response.status_code == status, response.text
    return response.json()["error"]


def complete(client, model: str, stream: bool = False, max_tokens: int = LONG_OUTPUT):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=stream,
                                     extra_body={"ignore_eos": True})


def model_ids(client) -> dict[str, object]:
    return {model.id: model for model in client.models.list().data}


def streamed_text(stream, first=None) -> str:
    chunks = ([first] if first is not None else []) + list(stream)
    return "".join(choice.text for chunk in chunks for choice in chunk.choices)


def test_load_and_unload_while_other_requests_stream(live, client, lora_adapters):
    r8_text, base_text = (complete(client, model).choices[0].text for model in ("r8", TEST_MODEL_NAME))
    on_r8, on_base = complete(client, "r8", stream=True), complete(client, TEST_MODEL_NAME, stream=True)
    first = next(iter(on_r8))  # the r8 request is running
    loaded = post(live, LOAD, {"lora_name": "late", "lora_path": str(lora_adapters["attn"])})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
    models = model_ids(client)
    assert list(models) == [TEST_MODEL_NAME, "r8", "late"]
    assert models["late"].parent == TEST_MODEL_NAME and models["late"].root == str(lora_adapters["attn"])
    late_text = complete(client, "late").choices[0].text
    assert late_text not in (r8_text, base_text)

    unloaded = post(live, UNLOAD, {"lora_name": "r8"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'r8' removed successfully."
    # the stream started on r8 finishes on r8, and the base's stream is untouched
    assert streamed_text(on_r8, first) == r8_text and streamed_text(on_base) == base_text
    assert list(model_ids(client)) == [TEST_MODEL_NAME, "late"]
    with pytest.raises(openai.NotFoundError) as refused:
        complete(client, "r8", max_tokens=2)
    assert refused.value.body["code"] == "model_not_found" and refused.value.body["param"] == "model"

    # loaded again under its name: the same weights, the same tokens (under a new id: a cold prefix cache)
    assert post(live, LOAD, {"lora_name": "r8", "lora_path": str(lora_adapters["r8"])}).status_code == 200
    assert complete(client, "r8").choices[0].text == r8_text
    assert complete(client, "late").choices[0].text == late_text
    assert post(live, UNLOAD, {"lora_name": "late"}).status_code == 200


def _widen_one_a(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter shaped for a wider base: one lora_A reads more input features than this base has."""
    name = next(name for name in sorted(weights) if name.endswith("q_proj.lora_A.weight"))
    return {**weights, name: torch.zeros(weights[name].shape[0], weights[name].shape[1] + 8)}


def _move_to_layer_99(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace("layers.0.", "layers.99."): tensor for name, tensor in weights.items()}


@pytest.mark.parametrize("make, body, status, code, says", [
    (None, {"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "invalid_lora_adapter", "not found"),
    ("r64", {"lora_name": "x"}, 400, "invalid_lora_adapter", "rank 64 is over --max-lora-rank 16"),
    ("wider", {"lora_name": "x"}, 400, "invalid_lora_adapter", "shaped for another base model"),
    ("layer99", {"lora_name": "x"}, 400, "invalid_lora_adapter", "does not serve LoRA on"),
    ("embed", {"lora_name": "x"}, 400, "invalid_lora_adapter", "embed_tokens"),
    ("r8", {"lora_name": "r8"}, 400, "lora_adapter_exists", "has already been loaded"),
    ("r8", {"lora_name": TEST_MODEL_NAME}, 400, None, "the base model's name"),
    (None, {"lora_name": "x"}, 400, None, "lora_path"),
])
def test_loads_refused_in_openai_shape(live, client, lora_adapters, tmp_path, make, body, status, code, says):
    sources = {"wider": dict(edit_weights=_widen_one_a), "layer99": dict(edit_weights=_move_to_layer_99),
               "embed": dict(target_modules=["q_proj", "embed_tokens"])}
    if make in sources:
        body = {**body, "lora_path": str(edited_adapter(lora_adapters["r8"], tmp_path / make, **sources[make]))}
    elif make is not None:
        body = {**body, "lora_path": str(lora_adapters[make])}
    error = error_of(post(live, LOAD, body), status)
    assert says in error["message"] and error["code"] == code
    assert "x" not in model_ids(client)


def test_a_refused_load_leaves_the_name_free(live, lora_adapters):
    error_of(post(live, LOAD, {"lora_name": "retry", "lora_path": str(lora_adapters["r64"])}), 400)
    assert post(live, LOAD, {"lora_name": "retry", "lora_path": str(lora_adapters["attn"])}).status_code == 200
    assert post(live, UNLOAD, {"lora_name": "retry"}).status_code == 200


def test_unloading_an_unknown_adapter_is_a_404(live):
    error = error_of(post(live, UNLOAD, {"lora_name": "never-loaded"}), 404)
    assert error["code"] == "lora_adapter_not_found" and error["param"] == "lora_name"
    assert "never-loaded" in error["message"]


@pytest.mark.anyio
async def test_without_the_flag_the_routes_are_404s_saying_how_to_enable_them(fake_engine):
    async with asgi_client(fake_engine) as client:
        for path, body in ((LOAD, {"lora_name": "a", "lora_path": "/a"}), (UNLOAD, {"lora_name": "a"})):
            error = error_of(await client.post(path, json=body), 404)
            assert error["code"] == "runtime_lora_updating_disabled"
            assert "--enable-runtime-lora-updating" in error["message"]


def test_the_flag_and_vllms_environment_variable_turn_it_on(tmp_path, monkeypatch):
    parser = build_parser()

    def runtime_updating(*flags: str) -> bool:
        return config_from_args(parser.parse_args(["serve", str(tmp_path), *flags])).runtime_lora_updating

    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    assert config_from_args(parser.parse_args(["serve", str(tmp_path), "--enable-lora"])).engine.lora == LoraConfig()
    assert runtime_updating("--enable-lora", "--enable-runtime-lora-updating")
    assert not runtime_updating("--enable-lora")
    with pytest.raises(ValueError, match="needs LoRA adapters enabled"):
        runtime_updating("--enable-runtime-lora-updating")
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    assert runtime_updating("--enable-lora")
    assert not runtime_updating()  # the variable alone does not turn LoRA on


@pytest.mark.slow  # a `mili serve` child and its engine process start: about a minute on a busy 2-core machine
def test_through_the_engine_process_turned_on_by_vllms_variable(tiny_checkpoint, lora_adapters, tmp_path,
                                                                monkeypatch):
    """`mili serve --engine-process` (CUDA's default) with VLLM_ALLOW_RUNTIME_LORA_UPDATING: loads and unloads
    cross to the engine's process, its refusals come back as the same 4xx, and /v1/models follows."""
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")  # the child inherits it
    flags = (*REAL_SERVE_FLAGS, "--engine-process", "--served-model-name", TEST_MODEL_NAME, "--enable-lora",
             "--max-lora-rank", str(MAX_RANK))
    with mili_serve_process("mili-lora-runtime", tiny_checkpoint, tmp_path / "server.log", *flags) as server:
        server.wait_healthy(START_TIMEOUT_S)
        base_url, client = server.spec.base_url, sdk_client(server.spec.base_url + "/v1")
        base_text = complete(client, TEST_MODEL_NAME, max_tokens=8).choices[0].text
        assert post(base_url, LOAD, {"lora_name": "attn", "lora_path": str(lora_adapters["attn"])}).status_code == 200
        assert list(model_ids(client)) == [TEST_MODEL_NAME, "attn"]
        assert complete(client, "attn", max_tokens=8).choices[0].text != base_text
        refused = error_of(post(base_url, LOAD, {"lora_name": "big", "lora_path": str(lora_adapters["r64"])}), 400)
        assert refused["code"] == "invalid_lora_adapter" and "rank 64" in refused["message"]
        again = error_of(post(base_url, LOAD, {"lora_name": "attn", "lora_path": str(lora_adapters["r8"])}), 400)
        assert again["code"] == "lora_adapter_exists"
        assert post(base_url, UNLOAD, {"lora_name": "attn"}).status_code == 200
        assert list(model_ids(client)) == [TEST_MODEL_NAME]
        assert error_of(post(base_url, UNLOAD, {"lora_name": "attn"}), 404)["code"] == "lora_adapter_not_found"
