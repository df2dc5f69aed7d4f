"""Qwen3.5's text format end to end through the real routes and the openai SDK: the prompt is Qwen3.5's template
(thinking opened by the template, tools in XML), and XML tool calls come back as OpenAI `tool_calls`, whole and
streamed in pieces, on /v1/chat/completions and /v1/responses.

The scripted engine writes what a Qwen3.5 model writes (a random-weight model never would). The last tests run
the real engine on a tiny random Qwen3 that speaks Qwen3.5's vocabulary and template: its one output token
forced to the `</tool_call>` that closes a prefilled call, and tool_choice "required" / a named function held
to XML calls by the grammar.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import openai
import pytest
from fake_engine import ScriptedEngine
from helpers_server import REAL_ENGINE_CONFIG, asgi_client, live_server, sdk_client, served_engine
from qwen35_helpers import qwen3_checkpoint_with_qwen35_tokenizer

from mili_openai.config import HERMES_TOOL_PARSER, ServerConfig
from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE
from mili_openai.server.app import create_app

MODEL = "scripted-qwen3.5"
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                       "hourly": {"type": "boolean"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                 "parameters": WEATHER_PARAMETERS}}
RESPONSES_WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast",
                          "parameters": WEATHER_PARAMETERS}
REASONING = "The user wants two forecasts."
ANSWER = "Let me check both."
CALLS_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
              "</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
# the template opened `<think>\n`: the output starts inside the thinking
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}\n\n{CALLS_TEXT}"
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3, "hourly": True}), ("get_weather", {"city": "Rome"})]
QUESTION = [{"role": "user", "content": "Weather in Paris and Rome?"}]
FORCED_BIAS = 100


class Qwen35ScriptedEngine(ScriptedEngine):
    """The scripted engine over Qwen3.5's vocabulary: its prompts hold ids past Qwen3's embedding rows."""

    def __init__(self, tokenizer, script: str) -> None:
        super().__init__(tokenizer, script, max_model_len=4096)
        self.info = dataclasses.replace(self.info, vocab_size=QWEN35_VOCAB_SIZE)


@pytest.fixture(scope="module")
def server(qwen35_tokenizer):
    engine = Qwen35ScriptedEngine(qwen35_tokenizer, SCRIPT)
    with live_server(create_app(ServerConfig(served_model_name=MODEL), engine=engine)) as live:
        live.engine = engine
        yield live


@pytest.fixture
def client(server):
    server.engine.script = SCRIPT
    return sdk_client(server.api_base)


def last_prompt(server) -> str:
    return server.engine.tokenizer.decode(server.engine.submitted[-1][0])


def test_whole_answer_has_reasoning_content_and_typed_xml_calls(server, client):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL])
    prompt = last_prompt(server)
    assert "<function=example_function_name>" in prompt and '"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWER and choice.message.model_extra["reasoning_content"] == REASONING
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_streamed_calls_announce_id_and_name_then_arguments_in_pieces(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL],
                                                 temperature=0, stream=True))
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    pieces = [call for d in deltas for call in d.tool_calls or []]
    by_index: dict[int, list] = {}
    for piece in pieces:
        by_index.setdefault(piece.index, []).append(piece)
    assert sorted(by_index) == [0, 1]
    for index, (first, *rest) in by_index.items():
        assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
        assert rest and all(p.id is None and p.function.name is None for p in rest)  # arguments came in pieces
        arguments = "".join(p.function.arguments or "" for p in [first, *rest])
        assert json.loads(arguments) == EXPECTED_CALLS[index][1]
        assert arguments == whole.choices[0].message.tool_calls[index].function.arguments
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_returns_reasoning_message_and_function_call_items(client, stream):
    request = dict(model=MODEL, input="Weather in Paris and Rome?", tools=[RESPONSES_WEATHER_TOOL])
    if stream:
        events = list(client.responses.create(**request, stream=True))
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len({e.item_id for e in deltas}) == 2 and len(deltas) > 2
        response = events[-1].response
    else:
        response = client.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[1].content[0].text == ANSWER
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)


def test_thinking_off_renders_an_empty_block_and_the_output_is_all_answer(server, client):
    server.engine.script = f"{ANSWER}\n\n{CALLS_TEXT}"
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL],
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert last_prompt(server).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = result.choices[0].message
    assert message.content == ANSWER and message.model_extra.get("reasoning_content") is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == EXPECTED_CALLS


def test_the_tool_history_goes_back_into_the_prompt_as_xml(server, client):
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL])
    assert last_prompt(server).endswith(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n")


def test_the_configured_parser_overrides_the_templates(qwen35_tokenizer):
    async def go() -> dict:
        engine = Qwen35ScriptedEngine(qwen35_tokenizer, f"{ANSWER}\n{CALLS_TEXT}")
        async with asgi_client(engine, tool_call_parser=HERMES_TOOL_PARSER) as http:
            response = await http.post("/v1/chat/completions", json={
                "messages": QUESTION, "tools": [WEATHER_TOOL], "chat_template_kwargs": {"enable_thinking": False}})
            return response.json()

    message = asyncio.run(go())["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"] == f"{ANSWER}\n{CALLS_TEXT}"  # not Hermes JSON


@pytest.fixture(scope="module")
def qwen35_vocab_server(tmp_path_factory):
    checkpoint = qwen3_checkpoint_with_qwen35_tokenizer(tmp_path_factory.mktemp("qwen3-qwen35-vocab"))
    engine_args = {key: value for key, value in REAL_ENGINE_CONFIG.items() if key != "dtype"}
    with served_engine(checkpoint, **engine_args) as (live, engine):
        yield live, engine


def test_real_engine_with_qwen35_vocabulary_closes_a_prefilled_xml_call(qwen35_vocab_server):
    live, engine = qwen35_vocab_server
    prefill = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    close = engine.info.tokenizer.convert_tokens_to_ids("</tool_call>")
    kwargs = dict(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=1, temperature=0,
                  logit_bias={str(close): FORCED_BIAS},
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    client = sdk_client(live.api_base)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kwargs) for c in chunk.choices]
    calls = [t for c in streamed for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]  # the prefill wrote it all: one piece


ENUM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "hourly": {"type": "boolean"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_real_engine_enforced_tool_choice_writes_xml_calls_of_the_schemas(qwen35_vocab_server, tool_choice):
    """A random model never writes a call by itself: the XML grammar holds it to one, values of their types."""
    live, _ = qwen35_vocab_server
    reply = sdk_client(live.api_base).chat.completions.create(
        model="tiny", messages=QUESTION, tools=ENUM_TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=80, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    ((name, arguments),) = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    if name == "get_time":
        assert arguments in ({"zone": "CET"}, {"zone": "UTC"})
    else:
        assert arguments["city"] in ("Paris", "Oslo") and set(arguments) <= {"city", "hourly"}
        assert isinstance(arguments.get("hourly", True), bool)
