"""XML tool calls (Qwen3.5 / Qwen3.6 / Qwen3-Coder, vLLM's qwen3_coder): values typed by the tool's schema,
several calls, text around them, malformed blocks kept as text, calls cut by the end, arguments streamed a
parameter at a time, and every split point giving the whole result. Also the parser each template picks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_parser_helpers import feed_in_pieces

from mili_openai.config import HERMES_TOOL_PARSER, XML_TOOL_PARSER, ServerConfig
from mili_openai.protocol.chat import ChatCompletionRequest, ToolDefinition
from mili_openai.protocol.chat_output import OutputOptions, parse_whole_output
from mili_openai.protocol.prompts import render_chat_text
from mili_openai.protocol.tool_call_parsers import model_tool_parser, template_tool_parser
from mili_openai.protocol.tool_calls import merge_pieces
from mili_openai.protocol.xml_tool_calls import XmlToolCallParser, typed_value

TOOLS = [ToolDefinition.model_validate(tool) for tool in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "hourly": {"type": "boolean"}, "fields": {"type": "array"}, "unit": {"type": "object"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "limit": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}},
]]


def call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", city="Paris", days="2")
TIME = call("get_time", tz="CET")
HERMES_BLOCK = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # not this format


def parse(text: str, max_calls: int | None = None, tools=TOOLS):
    """(content, whole calls) of `text` read at once: calls cut off by the end are left out."""
    parser = XmlToolCallParser(tools, max_calls=max_calls)
    delta, end = parser.feed(text), parser.finish()
    return delta.content + end.content, merge_pieces(delta.calls + end.calls, parser.incomplete_calls)


def stream(text: str, cuts: list[int]):
    """(content, calls the pieces make up, the pieces, the parser) of `text` fed in pieces cut at `cuts`."""
    parser = XmlToolCallParser(TOOLS)
    content, pieces = feed_in_pieces(parser, text, cuts)
    return content, merge_pieces(pieces), pieces, parser


def arguments(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_one_call_after_text_becomes_a_tool_call_with_typed_arguments():
    content, calls = parse("Let me check.\n\n" + WEATHER)
    assert content == "Let me check."
    assert arguments(calls) == [("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].arguments == '{"city": "Paris", "days": 2}' and calls[0].id.startswith("call_")


def test_several_calls_get_indexes_and_distinct_ids_and_text_between_stays():
    content, calls = parse("A\n" + WEATHER + "\nB\n" + TIME + "\nC")
    assert content == "ABC"
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(("parameter", "text", "value"), [
    ("days", "3", 3), ("days", "-12", -12), ("days", "two", "two"), ("days", "2.5", "2.5"),
    ("scale", "2.5", 2.5), ("scale", "4", 4), ("scale", "1e3", 1000.0), ("scale", "nan", "nan"),
    ("hourly", "true", True), ("hourly", "True", True), ("hourly", "FALSE", False), ("hourly", "yes", "yes"),
    ("fields", '["temp", "wind"]', ["temp", "wind"]), ("fields", "[1,", "[1,"), ("fields", '{"a": 1}', '{"a": 1}'),
    ("unit", '{"temp": "C", "n": [1]}', {"temp": "C", "n": [1]}), ("unit", "Celsius", "Celsius"),
    ("note", "null", None), ("note", "None", None), ("note", "a note", "a note"),
    ("limit", "5", 5), ("limit", "null", None),
    ("city", "42", "42"), ("city", "  spaced  ", "  spaced  "), ("undeclared", "7", "7"),
])
def test_values_are_typed_by_the_schema_and_stay_strings_when_they_are_not_that_type(parameter, text, value):
    _, calls = parse(call("get_weather", **{parameter: text}))
    assert json.loads(calls[0].arguments) == {parameter: value}


def test_unknown_functions_and_schemaless_tools_keep_strings():
    assert typed_value("3", None) == "3"
    _, calls = parse(call("not_a_tool", n="3"))
    assert arguments(calls) == [("not_a_tool", {"n": "3"})]
    _, calls = parse(call("get_weather", days="3"), tools=None)
    assert arguments(calls) == [("get_weather", {"days": "3"})]


def test_multiline_values_and_a_literal_end_tag_inside_a_value():
    code = "def f():\n    return '</parameter>' < 1\n"
    _, calls = parse(call("get_time", tz=code))
    assert arguments(calls) == [("get_time", {"tz": code})]


def test_a_call_with_no_parameters_and_a_missing_function_end():
    _, calls = parse("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    _, calls = parse("<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</tool_call>")
    assert arguments(calls) == [("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("block", [HERMES_BLOCK, "<tool_call>\n<function=get time>\n</function>\n</tool_call>",
                                   "<tool_call>\n<function=>\n</function>\n</tool_call>",
                                   "<tool_call>\nsure: <function=f>\n</function>\n</tool_call>"])
def test_blocks_that_are_not_xml_calls_stay_text_verbatim(block):
    text = "x " + block + " y"
    assert parse(text) == (text, [])
    assert parse(WEATHER + block + TIME)[0] == block  # between good calls too


def test_an_open_block_that_is_no_call_shows_as_text_at_the_end():
    assert parse("x\n<tool_call>\nnot xml") == ("x\n<tool_call>\nnot xml", [])


def test_an_unclosed_final_block_counts_once_its_function_closed():
    _, calls = parse(WEATHER.removesuffix("</tool_call>"))
    assert arguments(calls) == [("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize("cut", [len("<tool_call>\n<function=get_we"), WEATHER.index("Paris"),
                                 WEATHER.index("</parameter>\n<parameter=days>") + 5,
                                 WEATHER.index("</function>")])
def test_a_call_cut_by_the_end_is_dropped_whole_and_incomplete_when_streamed(cut):
    text = "Checking.\n" + TIME + "\n" + WEATHER[:cut]
    content, calls = parse(text)
    assert content == "Checking." and arguments(calls) == [("get_time", {"tz": "CET"})]
    _, _, pieces, parser = stream(text, [])
    if "get_weather>" in text:  # announced: the stream said so, and says it was cut
        assert [p.name for p in pieces if p.id] == ["get_time", "get_weather"] and parser.incomplete_calls == {1}


def test_arguments_stream_a_parameter_at_a_time():
    text = call("get_weather", city="Paris", days="2", hourly="true")
    _, calls, pieces, _ = stream(text, list(range(1, len(text))))
    first, *rest = pieces
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{") and first.id.startswith("call_")
    # the last value ends where `</function>` shows it does, so the closing brace comes with it
    assert [p.arguments for p in rest] == ['"city": "Paris"', ', "days": 2', ', "hourly": true}']
    assert all(p.id is None and p.name is None for p in rest)
    assert "".join(p.arguments for p in pieces) == calls[0].arguments == json.dumps(
        {"city": "Paris", "days": 2, "hourly": True})


def test_max_calls_keeps_the_first():
    assert [c.name for c in parse(WEATHER + TIME, max_calls=1)[1]] == ["get_weather"]


SPLIT_TEXTS = [
    "Let me check.\n\n" + WEATHER + "\n" + TIME,
    "x " + HERMES_BLOCK + " y",
    call("get_time", tz="a</parameter>b\n</parameter>x") + " trailing",
    WEATHER[:-20],
    "plain text, with trailing space ",
]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_every_single_split_point_gives_the_whole_result(text):
    whole_content, whole_calls = parse(text)
    for cut in range(len(text) + 1):
        content, calls, _, parser = stream(text, [cut])
        calls = [c for c in calls if c.index not in parser.incomplete_calls]
        assert content == whole_content, cut
        assert [(c.index, c.name, c.arguments) for c in calls] == [(c.index, c.name, c.arguments)
                                                                   for c in whole_calls], cut


def test_split_at_every_character_gives_the_whole_result():
    text = SPLIT_TEXTS[0]
    content, calls, _, _ = stream(text, list(range(len(text) + 1)))
    assert (content, [(c.name, c.arguments) for c in calls]) == (parse(text)[0], [(c.name, c.arguments)
                                                                                  for c in parse(text)[1]])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_split_into_many_pieces_gives_the_whole_result(data):
    parts = data.draw(st.lists(st.sampled_from([WEATHER, TIME, HERMES_BLOCK, "text ", "\n", "<tool", "</tool_call>",
                                                "<function=f>", "</parameter>"]), max_size=6))
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    whole_content, whole_calls = parse(text)
    content, calls, _, parser = stream(text, cuts)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls if c.index not in parser.incomplete_calls] == [
        (c.name, c.arguments) for c in whole_calls]


def test_a_call_the_template_renders_in_history_parses_back_to_its_arguments(qwen35_tokenizer):
    sent = {"city": "Paris", "days": 2, "scale": 1.5, "hourly": True, "fields": ["temp"], "unit": {"t": "C"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(sent)}}]}]
    request = ChatCompletionRequest.model_validate({"messages": history, "add_generation_prompt": False})
    text, _ = render_chat_text(qwen35_tokenizer, request)
    answer = text.split("</think>\n\n")[-1].removesuffix("<|im_end|>\n")
    assert answer.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>")
    assert arguments(parse(answer)[1]) == [("get_weather", sent)]


def test_qwen35_output_after_the_template_thinks_then_calls(qwen35_tokenizer):
    options = OutputOptions(split_reasoning=True, include_reasoning=True, parse_tools=True, max_calls=None,
                            tool_parser=XML_TOOL_PARSER, tools=TOOLS)
    output = f"I should look it up.\n</think>\n\nSure.\n\n{WEATHER}"
    whole = parse_whole_output(output, "<think>\n", options)
    assert (whole.reasoning, whole.content) == ("I should look it up.", "Sure.")
    assert arguments(whole.calls) == [("get_weather", {"city": "Paris", "days": 2})]


def test_the_parser_is_the_one_the_template_teaches_unless_configured(qwen35_tokenizer, qwen_tokenizer):
    assert template_tool_parser(qwen35_tokenizer.chat_template) == XML_TOOL_PARSER
    assert template_tool_parser(qwen_tokenizer.chat_template) == HERMES_TOOL_PARSER
    assert template_tool_parser(None) == HERMES_TOOL_PARSER
    assert model_tool_parser(HERMES_TOOL_PARSER, qwen35_tokenizer) == HERMES_TOOL_PARSER
    assert model_tool_parser(None, qwen35_tokenizer) == XML_TOOL_PARSER
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="pythonic")
