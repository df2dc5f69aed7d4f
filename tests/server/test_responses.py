"""/v1/responses through the real openai SDK (whole, `responses.stream`, `stream=True`, `retrieve`) over real
HTTP, with the scripted fake engine behind it: reasoning, answers and tool calls a random-weight model would
never write, output cut by max_output_tokens, the stored conversation, errors in OpenAI's shape. The real
engine and the agents SDK are in test_clients.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers_server import scripted_server as serve_script
from mili_openai.server.state import ResponseStore, StoredResponse

MODEL = "scripted-qwen3"
THINKING_TEXT = "<think>\nThe user greets me.\n</think>\n\nHello there!"
TOOL_CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(qwen_tokenizer):
    with serve_script(qwen_tokenizer, THINKING_TEXT, MODEL, responses_store_size=8) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0)


def last_prompt(server) -> str:
    return server.engine.info.tokenizer.decode(server.engine.submitted[-1][0])


def test_reasoning_and_answer_come_as_items_with_usage(server, client):
    server.engine.script = THINKING_TEXT
    response = client.responses.create(model=MODEL, input="hi", instructions="Be brief.")
    assert response.status == "completed" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "The user greets me."
    assert response.output_text == "Hello there!"
    usage = response.usage
    assert usage.input_tokens == len(server.engine.submitted[-1][0]) and usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens == len(server.engine.info.tokenizer.encode(THINKING_TEXT))
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert last_prompt(server).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_stream_helper_assembles_the_same_response(server, client):
    server.engine.script = THINKING_TEXT
    with client.responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user greets me."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there!"
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    assert final.output_text == "Hello there!" and [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_raw_stream_names_each_event(server):
    server.engine.script = "Hello there!"
    body = {"model": MODEL, "input": "hi", "stream": True}
    text = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).text
    names = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in text.splitlines()
             if line.startswith("data: ") and line != "data: [DONE]"]
    assert names == [data["type"] for data in datas]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_are_items_with_arguments_in_pieces(server, client, stream):
    server.engine.script = TOOL_CALL_TEXT
    request = dict(model=MODEL, input="weather in Paris and Rome?", tools=[WEATHER_TOOL])
    if stream:
        events = list(client.responses.create(**request, stream=True))
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 4 and len({e.item_id for e in deltas}) == 2
        response = events[-1].response
    else:
        response = client.responses.create(**request)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Rome"})]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_makes_it_incomplete(server, client, stream):
    server.engine.script = THINKING_TEXT
    request = dict(model=MODEL, input="hi", max_output_tokens=3)
    response = (list(client.responses.create(**request, stream=True))[-1].response if stream
                else client.responses.create(**request))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_function_call_outputs_and_previous_response_continue_the_conversation(server, client):
    server.engine.script = TOOL_CALL_TEXT
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER_TOOL])
    call = next(item for item in first.output if item.type == "function_call")
    server.engine.script = "It is sunny."
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}])
    prompt = last_prompt(server)
    assert "weather in Paris?" in prompt and '"city": "Paris"' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert second.previous_response_id == first.id and second.output_text == "It is sunny."
    assert client.responses.retrieve(second.id).output_text == "It is sunny."


def test_a_whole_conversation_given_as_items(server, client):
    server.engine.script = "Done."
    client.responses.create(model=MODEL, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ], tools=[WEATHER_TOOL])
    prompt = last_prompt(server)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt and "rain" in prompt


def test_store_false_is_not_kept_and_delete_forgets(server, client):
    server.engine.script = "Hello there!"
    unstored = client.responses.create(model=MODEL, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    stored = client.responses.create(model=MODEL, input="hi")
    assert client.responses.retrieve(stored.id).id == stored.id
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(stored.id)
    assert error.value.body["code"] == "response_not_found"


def test_store_keeps_the_latest():
    store = ResponseStore(max_size=2)
    for name in ("a", "b", "c"):
        store.put(StoredResponse({"id": name}, []))
    assert len(store) == 2 and store.get("c").response["id"] == "c"
    with pytest.raises(Exception, match="not found"):
        store.get("a")
    ResponseStore(0).put(StoredResponse({"id": "x"}, []))  # a store of size 0 keeps nothing, quietly


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    # an image to this text-only model: refused where the chat path reads it
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "messages[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]}, 400, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    response = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "invalid_request_error"
