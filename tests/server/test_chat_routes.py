"""/v1/chat/completions over real HTTP (uvicorn) with a scripted fake engine behind it.

The fake engine (`ScriptedEngine`) streams a fixed text token by token, so the route's post-processing
(reasoning split, tool-call parsing, chunk shapes, finish reasons) is tested on outputs a random-weight
model would never write. The real-engine tests are in test_chat_server.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import orjson
import pytest

from fake_engine import TOOL_CALL_TEXT
from helpers_server import scripted_server as serve_script

MODEL = "scripted-qwen3"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THINKING_TEXT = "<think>\nThe user greets me.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def server(qwen_tokenizer):
    with serve_script(qwen_tokenizer, THINKING_TEXT, MODEL) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0)


def chat(server, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body, [DONE] kept as the string."""
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_reasoning_is_split_from_content(server, client):
    server.engine.script = THINKING_TEXT
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    message = result.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "The user greets me."
    assert message.model_extra["reasoning"] == "The user greets me."
    assert result.choices[0].finish_reason == "stop"
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")


def test_include_reasoning_false_drops_the_thinking(server):
    server.engine.script = THINKING_TEXT
    message = chat(server, include_reasoning=False).json()["choices"][0]["message"]
    assert message["content"] == "Hello there!" and message["reasoning_content"] is None


def test_tool_calls_are_parsed_with_finish_reason_tool_calls(server, client):
    server.engine.script = TOOL_CALL_TEXT
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER_TOOL])
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Rome"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_streamed_tool_calls_accumulate_to_the_same_calls(server, client):
    server.engine.script = TOOL_CALL_TEXT
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER_TOOL], stream=True)
    content, calls, finishes, roles = "", {}, [], 0
    for chunk in stream:
        for choice in chunk.choices:
            roles += choice.delta.role == "assistant"
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert roles == 1 and finishes == ["tool_calls"] and content == "I will look it up."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_none_leaves_the_text_alone_but_shows_the_tools(server):
    server.engine.script = TOOL_CALL_TEXT
    body = chat(server, tools=[WEATHER_TOOL], tool_choice="none").json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == TOOL_CALL_TEXT and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    prompt = server.engine.info.tokenizer.decode(server.engine.submitted[-1][0])
    assert "get_weather" in prompt  # as in vLLM: "none" still renders the tools into the prompt


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    server.engine.script = TOOL_CALL_TEXT
    message = chat(server, tools=[WEATHER_TOOL], parallel_tool_calls=False).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]


def test_named_tool_choice_sends_a_grammar_and_parses_the_call(server):
    server.engine.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    body = chat(server, tools=[WEATHER_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()
    prompt_ids, params, _ = server.engine.submitted[-1]
    assert server.engine.info.tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")  # no prefill
    grammar = params.structured_outputs.grammar
    assert '"const": "get_weather"' in grammar and "call_1" not in grammar  # this function, one call
    assert params.structured_outputs.reasoning == "optional"  # the template lets Qwen3 think first
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_malformed_tool_call_comes_back_as_content(server):
    server.engine.script = '<tool_call>\n{"name": "get_weather" "arguments": {"city": 1}}\n</tool_call>'
    choice = chat(server, tools=[WEATHER_TOOL]).json()["choices"][0]
    assert choice["message"]["content"] == server.engine.script
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "stop"


def streamed_calls(stream) -> tuple[str, dict[int, dict], list[str], dict[int, int]]:
    """(content, calls merged by index, finish reasons, argument pieces per call) of a streamed chat."""
    content, calls, finishes, pieces = "", {}, [], {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                assert (call.id is None) == (call.index in pieces)  # the id comes once, first
                pieces[call.index] = pieces.get(call.index, 0) + 1
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return content, calls, finishes, pieces


def test_streamed_arguments_arrive_in_pieces(server, client):
    server.engine.script = TOOL_CALL_TEXT
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER_TOOL], stream=True)
    _, calls, _, pieces = streamed_calls(stream)
    assert all(count > 2 for count in pieces.values())  # the name first, then the arguments token by token
    assert [c["arguments"] for c in calls.values()] == ['{"city": "Paris"}', '{"city": "Rome"}']


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_finishes_with_length_and_leaks_nothing(server, client, stream):
    server.engine.script = TOOL_CALL_TEXT
    tokens = server.engine.info.tokenizer.encode(TOOL_CALL_TEXT, add_special_tokens=False)
    cut = TOOL_CALL_TEXT.index('"Rome"')  # inside the second call's arguments
    max_tokens = next(n for n in range(len(tokens)) if len(server.engine.info.tokenizer.decode(tokens[:n])) >= cut)
    request = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
                   max_tokens=max_tokens)
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "length" and choice.message.content == "I will look it up."
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')]
        return
    content, calls, finishes, _ = streamed_calls(client.chat.completions.create(**request, stream=True))
    assert finishes == ["length"] and content == "I will look it up."
    assert calls[0]["arguments"] == '{"city": "Paris"}'
    # the second call was announced before the cut; its arguments end where the output did
    assert calls[1]["name"] == "get_weather" and not calls[1]["arguments"].endswith("}")


def test_a_call_cut_before_its_head_is_dropped(server):
    server.engine.script = 'Sure.\n<tool_call>\n{"name": "get_weather", "argu'
    for stream in (False, True):
        response = chat(server, tools=[WEATHER_TOOL], stream=stream)
        if stream:
            deltas = [e["choices"][0]["delta"] for e in sse_events(response)[:-1] if e["choices"]]
            assert "".join(d.get("content", "") for d in deltas) == "Sure."
            assert not any("tool_calls" in d for d in deltas)
        else:
            message = response.json()["choices"][0]["message"]
            assert message["content"] == "Sure." and message["tool_calls"] == []


def test_raw_sse_wire_format(server):
    server.engine.script = THINKING_TEXT
    response = chat(server, stream=True, n=2, stream_options={"include_usage": True}, logprobs=True,
                    top_logprobs=1)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.text.replace("\r\n", "\n").rstrip("\n").endswith("data: [DONE]")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop"
        assert "".join(c["delta"].get("reasoning_content", "") for c in mine) == "The user greets me."
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hello there!"
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert "".join(t["token"] for t in tokens) == THINKING_TEXT
        assert all(len(t["top_logprobs"]) == 1 and bytes(t["bytes"]).decode() == t["token"] for t in tokens)
    assert all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    num_tokens = len(server.engine.info.tokenizer.encode(THINKING_TEXT))
    assert usage["completion_tokens"] == 2 * num_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stream_without_usage_has_no_usage_key(server):
    events = sse_events(chat(server, stream=True))
    assert all("usage" not in event for event in events[:-1])


def test_non_streamed_response_shape(server):
    server.engine.script = THINKING_TEXT
    body = chat(server, logprobs=True, top_logprobs=2, max_completion_tokens=3).json()
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == 3
    assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "not supported"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"top_logprobs": 2}, "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs at least one tool"),
        ({"messages": [{"role": "assistant", "content": None}]}, "content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 5000}, "maximum context length is 1024"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
          "continue_final_message": True}, "assistant"),
        ({"messages": [{"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": "{not json"}}]}]}, "not valid JSON"),
    ],
)
def test_bad_requests_are_400_with_a_clear_message(server, body, needle):
    response = chat(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle == error["param"], error
    assert error["type"] == "invalid_request_error"


def test_unknown_model_is_404(server):
    assert chat(server, model="gpt-4").status_code == 404


def test_text_parts_and_developer_role_reach_the_template(server):
    chat(server, messages=[{"role": "developer", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                                 {"type": "text", "text": "lo"}]}])
    prompt = server.engine.info.tokenizer.decode(server.engine.submitted[-1][0])
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>")


def test_chunk_events_serialise_with_orjson(server):
    # the deltas carry only what they set; chunks keep finish_reason even when null
    events = sse_events(chat(server, stream=True))
    assert all("finish_reason" in c["choices"][0] for c in events[:-1] if c["choices"])
    assert orjson.loads(orjson.dumps(events[1]))["choices"][0]["delta"].keys() <= {"content", "reasoning_content",
                                                                                    "reasoning", "tool_calls"}


@pytest.mark.parametrize("content", [None, "Hello", ""])
@pytest.mark.parametrize("reasoning", [None, "thinking"])
@pytest.mark.parametrize(("finish_reason", "stop_reason"), [(None, None), ("stop", None), ("stop", "END"),
                                                             ("stop", 151645), ("length", None)])
@pytest.mark.parametrize("with_usage_key", [False, True])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_text_chunk_event_is_the_models_chunk(content, reasoning, finish_reason, stop_reason, with_usage_key,
                                              with_logprobs):
    """The dict a chunk without tool calls is built as (most of a stream) is the one the pydantic models give."""
    from mili_openai.protocol.chat import (
        ChatCompletionChunk,
        ChoiceLogprobs,
        ChunkChoice,
        DeltaMessage,
        TokenLogprobOut,
        TopLogprob,
        text_chunk_event,
    )

    content = content or None  # as the route passes it
    logprobs = None
    if with_logprobs:
        top = TopLogprob(token="Hel", logprob=-0.25, bytes=[72, 101, 108])
        logprobs = ChoiceLogprobs(content=[TokenLogprobOut(token="\ufffd", logprob=-1.5, bytes=[240, 159],
                                                           top_logprobs=[top])])
    message = DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)
    choice = ChunkChoice(index=2, delta=message, logprobs=logprobs, finish_reason=finish_reason,
                         stop_reason=stop_reason)
    expected = ChatCompletionChunk(id="chatcmpl-1", created=7, model=MODEL, choices=[choice]).to_event()
    if not with_usage_key:
        del expected["usage"]
    event = text_chunk_event("chatcmpl-1", 7, MODEL, 2, content, reasoning, finish_reason, stop_reason, with_usage_key,
                             logprobs.model_dump() if logprobs is not None else None)
    assert orjson.dumps(event) == orjson.dumps(expected)  # same keys, same order, same values
