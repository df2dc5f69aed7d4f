"""Structured outputs through a real server: formats compiled off the event loop, OpenAI's response_format, vLLM's
structured_outputs and guided_* parameters, LangChain's with_structured_output, and tool_choice "required" / a named
function held to the functions' schemas. The tiny random model writes no JSON on its own, so a valid output is the
grammar's doing."""

from __future__ import annotations

import json
import re
import threading

import openai
import pytest
from langchain_openai import ChatOpenAI

from helpers_server import served_engine
from structured_helpers import CHOICES, GBNF, GRAMMAR, GRAMMAR_REGEX, REGEX, SCHEMA, conforms


class CallRecorder:
    """Stands in for a callable (a class too: attributes pass through) and records the threads it ran on."""

    def __init__(self, wrapped) -> None:
        self.wrapped, self.threads = wrapped, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.wrapped(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def test_the_server_compiles_formats_off_its_event_loop(tiny_checkpoint, monkeypatch):
    """The server builds llguidance's view of the tokenizer while loading, and compiles each request's
    format on a worker thread: the event loop, which every stream shares, only copies compiled matchers."""
    import llguidance
    import llguidance.hf

    with served_engine(tiny_checkpoint, num_pages=64, page_size=8) as (live, _):
        compiles = CallRecorder(llguidance.LLMatcher)
        # either way of building a view: from the tokenizer object, or from its serialised form (the engine's)
        views = CallRecorder(llguidance.hf.from_tokenizer), CallRecorder(llguidance.LLTokenizer)
        monkeypatch.setattr(llguidance, "LLMatcher", compiles)
        monkeypatch.setattr(llguidance.hf, "from_tokenizer", views[0])
        monkeypatch.setattr(llguidance, "LLTokenizer", views[1])
        client = openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        for n in (1, 3):  # the second request and its three samples copy the first one's compiled format
            reply = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=0, n=n,
                                              extra_body={"structured_outputs": {"regex": "[xyz]{4}"}})
            assert all(re.fullmatch("[xyz]{4}", choice.text) for choice in reply.choices)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0, extra_body={
                                                   "guided_choice": CHOICES,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
        assert reply.choices[0].message.content in CHOICES
    assert [view.threads for view in views] == [[], []]  # built at load
    assert len(compiles.threads) == 2 and "uvicorn-test" not in compiles.threads  # the loop's thread


def test_formats_through_a_real_server(tiny_checkpoint):
    """OpenAI's response_format on chat (whole and streamed), vLLM's structured_outputs and guided_* on
    completions, LangChain's with_structured_output; bad formats are 400s, and an unconstrained request
    beside a constrained one keeps its tokens."""
    with served_engine(tiny_checkpoint, num_pages=128, page_size=8) as (live, _):
        client = openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Pick a color."}]
        json_schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
        # no thinking: a random model given the choice would think until max_tokens (see the test below)
        no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
        reply = client.chat.completions.create(model="tiny", messages=messages, response_format=json_schema,
                                               max_tokens=60, temperature=0, extra_body=no_thinking)
        assert conforms(reply.choices[0].message.content) and reply.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model="tiny", messages=messages, response_format=json_schema,
                                                max_tokens=60, temperature=0.9, seed=5, stream=True,
                                                extra_body=no_thinking)
        assert conforms("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                               response_format={"type": "json_object"}, extra_body=no_thinking)
        assert reply.choices[0].message.content.startswith("{")

        def complete(**extra):
            return client.completions.create(model="tiny", prompt="Answer:", max_tokens=30, temperature=0,
                                             extra_body=extra).choices[0].text

        assert complete(structured_outputs={"choice": CHOICES}) in CHOICES
        assert complete(guided_choice=CHOICES) in CHOICES
        assert re.fullmatch(REGEX, complete(structured_outputs={"regex": REGEX}))
        assert re.fullmatch(REGEX, complete(guided_regex=REGEX))
        assert conforms(complete(guided_json=SCHEMA))
        assert re.fullmatch(GRAMMAR_REGEX, complete(structured_outputs={"grammar": GRAMMAR}))
        assert re.fullmatch(GRAMMAR_REGEX, complete(guided_grammar=GRAMMAR))
        assert re.fullmatch(GRAMMAR_REGEX, complete(guided_grammar=GBNF))
        free = client.completions.create(model="tiny", prompt="Answer:", max_tokens=12, temperature=0)

        for extra, param in [({"guided_regex": "[ab"}, None), ({"guided_regex": "a", "guided_choice": ["a"]}, None),
                             ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                              "response_format")]:
            with pytest.raises(openai.BadRequestError) as error:
                complete(**extra)
            if param is not None:
                assert error.value.body["param"] == param

        chat_model = ChatOpenAI(base_url=live.api_base, api_key="unused", model="tiny", temperature=0, max_tokens=60,
                                max_retries=0, extra_body=no_thinking)
        picked = chat_model.with_structured_output({**SCHEMA, "title": "Pick"}, method="json_schema").invoke("Pick.")
        assert conforms(json.dumps(picked))
        again = client.completions.create(model="tiny", prompt="Answer:", max_tokens=12, temperature=0)
        assert again.choices[0].text == free.choices[0].text


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_required_and_named_tool_choice_are_enforced(tiny_checkpoint):
    """A random model never writes a tool call by itself; with tool_choice "required" or a named function
    its output is held to calls whose arguments meet the function's schema, and comes back as tool_calls."""
    with served_engine(tiny_checkpoint, num_pages=64, page_size=8) as (live, _):
        client = openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)

        def calls(**kwargs):
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME],
                max_tokens=80, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                **kwargs)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]

        named = calls(tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert len(named) == 1 and named[0][0] == "get_time" and -12 <= named[0][1]["zone"] <= 12
        required = calls(tool_choice="required", parallel_tool_calls=False)
        assert len(required) == 1 and required[0][0] in ("get_weather", "get_time")
        name, args = required[0]
        assert args in ({"city": "Paris"}, {"city": "Oslo"}) if name == "get_weather" else -12 <= args["zone"] <= 12
        # an output format shapes text, and the output is calls: the calls' grammar holds (agents send both)
        with_format = calls(tool_choice="required", parallel_tool_calls=False, response_format={"type": "json_object"})
        assert len(with_format) == 1 and with_format[0][0] in ("get_weather", "get_time")
