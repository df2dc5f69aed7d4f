"""The embedded tiny random Qwen3.5 (`mili serve mili-tiny-random-qwen3.5`): built on first use with no download,
served under its name with Qwen3.5's tokenizer and chat template, and its tool calls parsed as the template's XML
(no --tool-call-parser given), through the real server and the openai SDK."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers_server import live_server, sdk_client

from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.model.default_model import TINY_QWEN35_CONFIG, TINY_QWEN35_NAME, resolve_model_path
from mili_openai.model.qwen35_tokenizer import EOS_TOKEN_IDS, QWEN35_VOCAB_SIZE
from mili_openai.server.app import create_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}}, "required": ["city"]}}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("embedded-models")


@pytest.fixture(scope="module")
def server(cache_dir):
    """As `mili serve mili-tiny-random-qwen3.5` runs it, the engine built (and the model with it) before the
    server starts, not within its start-up timeout."""
    config = EngineConfig(model=TINY_QWEN35_NAME, default_model_cache=str(cache_dir), dtype="float32", num_pages=64,
                          page_size=8, max_model_len=512, max_num_batched_tokens=64)
    engine = AsyncEngine(config)
    with live_server(create_app(ServerConfig(engine=config, request_timeout_s=60.0), engine=engine)) as live:
        yield live


def test_it_is_built_once_in_the_cache_with_qwen35_files(server, cache_dir):
    path = resolve_model_path(TINY_QWEN35_NAME, str(cache_dir))
    assert [p.name for p in cache_dir.iterdir()] == [path.name]  # built once, no staging dir left
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["vocab_size"] == QWEN35_VOCAB_SIZE == TINY_QWEN35_CONFIG["vocab_size"]
    assert (path / "chat_template.jinja").is_file() and (path / "tokenizer.json").is_file()
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == list(EOS_TOKEN_IDS)


def test_served_under_its_name(server):
    client = sdk_client(server.api_base)
    assert [model.id for model in client.models.list()] == [TINY_QWEN35_NAME]
    reply = client.chat.completions.create(model=TINY_QWEN35_NAME, messages=QUESTION, max_tokens=8, temperature=0,
                                           extra_body=NO_THINKING)
    streamed = client.chat.completions.create(model=TINY_QWEN35_NAME, messages=QUESTION, max_tokens=8, temperature=0,
                                              extra_body=NO_THINKING, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert reply.usage.completion_tokens == 8 and text == reply.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_as_the_templates_xml(server, stream):
    """A random model writes a call only when held to one: tool_choice "required" compiles the XML grammar, and
    the parser the template chose turns the XML into OpenAI tool_calls."""
    reply = sdk_client(server.api_base).chat.completions.create(
        model=TINY_QWEN35_NAME, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0, extra_body=NO_THINKING, stream=stream)
    if stream:
        chunks = [choice for chunk in reply for choice in chunk.choices]
        pieces = [call for choice in chunks for call in choice.delta.tool_calls or []]
        names = [piece.function.name for piece in pieces if piece.function.name]
        arguments = json.loads("".join(piece.function.arguments or "" for piece in pieces))
        finish = [choice.finish_reason for choice in chunks if choice.finish_reason]
    else:
        choice = reply.choices[0]
        names = [call.function.name for call in choice.message.tool_calls]
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        finish = [choice.finish_reason]
    assert names == ["get_weather"] and finish == ["tool_calls"]
    assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments.get("days", 0), int)


def test_metrics_show_the_state_pool(server):
    assert "mili_state_slots" in httpx.get(f"{server.base_url}/metrics").text
