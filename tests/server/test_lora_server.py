"""LoRA adapters through a real server and the openai SDK: listed in /v1/models with the base as parent, picked by a
request's `model`, answering as the offline `LLM` does with the same adapter; an unknown model is a 404 in OpenAI's
shape; the `mili serve` flags build the config."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine_helpers import random_prompts
from helpers_server import REAL_ENGINE_CONFIG, TEST_MODEL_NAME, live_server
from mili_openai import LLM, SamplingParams
from mili_openai.cli import build_parser, config_from_args
from mili_openai.config import EngineConfig, LoraConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app

ADAPTERS = ("r8", "attn")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_config(lora_adapters):
    return LoraConfig(modules=tuple((name, str(lora_adapters[name])) for name in ADAPTERS), max_loras=2)


@pytest.fixture(scope="module")
def live(tiny_checkpoint, lora_config):
    # where the CPU kernels are not built yet, serve on torch's ops rather than wait for them
    engine_config = EngineConfig(model=str(tiny_checkpoint), lora=lora_config, cpu_kernels_in_background=True,
                                 **REAL_ENGINE_CONFIG)
    app = create_app(ServerConfig(engine=engine_config, served_model_name=TEST_MODEL_NAME, request_timeout_s=60.0),
                     engine=AsyncEngine(engine_config))
    with live_server(app) as server:
        yield server


@pytest.fixture(scope="module")
def api_base(live):
    return live.api_base


@pytest.fixture(scope="module")
def offline_texts(tiny_checkpoint, lora_config):
    """{model name: greedy texts of PROMPTS} from the offline LLM with the same adapters."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=REAL_ENGINE_CONFIG["num_pages"], lora=lora_config,
              cpu_kernels_in_background=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {name: [output.outputs[0].text for output in llm.generate(PROMPTS, params, lora_request=adapter)]
            for name, adapter in [(TEST_MODEL_NAME, None), *((name, name) for name in ADAPTERS)]}


PROMPTS = random_prompts(2, [6, 30], seed=17)


def test_models_lists_each_adapter_under_the_base(client, lora_adapters):
    models = {model.id: model for model in client.models.list().data}
    assert list(models) == [TEST_MODEL_NAME, *ADAPTERS]
    for name in ADAPTERS:
        assert models[name].parent == TEST_MODEL_NAME and models[name].root == str(lora_adapters[name])
    assert models[TEST_MODEL_NAME].parent is None


def test_model_field_picks_the_adapter(client, offline_texts):
    for name, texts in offline_texts.items():
        for prompt, text in zip(PROMPTS, texts):
            completion = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert completion.model == name and completion.choices[0].text == text
    assert len({texts[1] for texts in offline_texts.values()}) == len(offline_texts)  # each adapter tells apart


def test_adapters_stream_side_by_side(client, offline_texts):
    streams = {name: client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
               for name in offline_texts}
    for name, stream in streams.items():
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {name}
        assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == offline_texts[name][1]


def test_chat_answers_as_the_adapter(client):
    reply = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0)
    assert reply.model == "attn" and reply.choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "no-such-adapter" in error["message"]


def test_metrics_show_the_adapters_as_vllm_does(live):
    text = httpx.get(f"{live.base_url}/metrics").text
    [line] = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line


def test_serve_flags_build_the_lora_config(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["serve", str(tmp_path), "--enable-lora", "--lora-modules", "a=/x/a",
                              '{"name": "b", "path": "/x/b"}', "--max-loras", "2", "--max-lora-rank", "32",
                              "--max-cpu-loras", "4"])
    lora = config_from_args(args).engine.lora
    assert lora == LoraConfig(modules=(("a", "/x/a"), ("b", "/x/b")), max_loras=2, max_cpu_loras=4, max_lora_rank=32)
    assert config_from_args(parser.parse_args(["serve", str(tmp_path)])).engine.lora is None
    for bad in (["--lora-modules", "a=/x"], ["--enable-lora", "--lora-modules", "nopath"],
                ["--enable-lora", "--lora-modules", "a=/x", "a=/y"], ["--enable-lora", "--max-loras", "0"]):
        with pytest.raises(ValueError):
            config_from_args(parser.parse_args(["serve", str(tmp_path), *bad]))
