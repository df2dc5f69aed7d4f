"""Hermes-style tool calls: several blocks, malformed JSON, text around calls, arguments streamed in pieces,
calls cut by the end of the output, every split point."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_parser_helpers import feed_in_pieces

from mili_openai.protocol.hermes_tool_calls import HermesToolCallParser, parse_call_block
from mili_openai.protocol.tool_calls import ParsedToolCall, merge_pieces


@dataclass
class Whole:
    content: str
    calls: list[ParsedToolCall]


def parse_tool_calls(text: str, prompt_tail: str = "", max_calls: int | None = None) -> Whole:
    """Whole-output form of the stream parser: calls cut off by the end are left out."""
    parser = HermesToolCallParser(max_calls)
    parser.prime(prompt_tail)
    delta = parser.feed(text)
    end = parser.finish()
    return Whole(delta.content + end.content, merge_pieces(delta.calls + end.calls, parser.incomplete_calls))


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather" "arguments": {"city": 1}}\n</tool_call>'  # no comma: no call


def calls_of(delta):
    return [(c.index, c.name, json.loads(c.arguments)) for c in delta.calls]


def stream(text: str, cuts: list[int], max_calls: int | None = None, tail: str = ""):
    """(content, calls the pieces make up, the pieces) of `text` fed in pieces cut at `cuts`."""
    parser = HermesToolCallParser(max_calls)
    parser.prime(tail)
    content, pieces = feed_in_pieces(parser, text, cuts)
    return content, merge_pieces(pieces), pieces


def test_one_call_with_text_before():
    delta = parse_tool_calls("Let me check.\n" + WEATHER)
    assert delta.content == "Let me check."
    assert calls_of(delta) == [(0, "get_weather", {"city": "Paris", "unit": "c"})]
    assert delta.calls[0].id.startswith("call_") and len(delta.calls[0].id) > len("call_")


def test_several_calls_get_indexes_and_distinct_ids():
    delta = parse_tool_calls(WEATHER + "\n" + TIME + "\n")
    assert delta.content == ""
    assert calls_of(delta) == [(0, "get_weather", {"city": "Paris", "unit": "c"}), (1, "get_time", {"tz": "CET"})]
    assert delta.calls[0].id != delta.calls[1].id


def test_text_between_and_after_calls_stays_content():
    delta = parse_tool_calls("A\n" + WEATHER + "\nB\n" + TIME + "\nC")
    assert delta.content == "ABC"  # whitespace that only separates text from blocks is dropped
    assert [c.name for c in delta.calls] == ["get_weather", "get_time"]


def test_malformed_json_stays_content_verbatim():
    text = "x " + MALFORMED + " y"
    delta = parse_tool_calls(text)
    assert delta.calls == [] and delta.content == text


def test_malformed_block_between_good_ones():
    delta = parse_tool_calls(WEATHER + MALFORMED + TIME)
    assert [c.name for c in delta.calls] == ["get_weather", "get_time"]
    assert delta.content == MALFORMED


@pytest.mark.parametrize("body", ['["a list"]', '{"arguments": {}}', '{"name": "", "arguments": {}}',
                                  '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "not json"}'])
def test_blocks_that_are_not_calls(body):
    assert parse_call_block(body) is None


def test_arguments_given_as_a_json_string_or_missing():
    assert parse_call_block('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')
    assert parse_call_block('{"name": "f"}') == ("f", "{}")


def test_unclosed_final_block_counts_when_its_json_is_complete():
    delta = parse_tool_calls(WEATHER.removesuffix("</tool_call>"))
    assert [c.name for c in delta.calls] == ["get_weather"]


@pytest.mark.parametrize("cut", [len("<tool_call>\n{\"name\": \"get"), WEATHER.index('"Paris"'), len(WEATHER) - 20])
def test_a_call_cut_by_the_end_is_dropped_and_the_complete_ones_kept(cut):
    text = "Checking.\n" + TIME + "\n" + WEATHER[:cut]
    delta = parse_tool_calls(text)
    assert delta.content == "Checking." and calls_of(delta) == [(0, "get_time", {"tz": "CET"})]


def test_a_streamed_call_cut_by_the_end_says_so():
    parser = HermesToolCallParser()
    pieces = parser.feed(TIME + WEATHER[:WEATHER.index('"Paris"')]).calls + parser.finish().calls
    assert [(p.index, p.name) for p in pieces if p.id] == [(0, "get_time"), (1, "get_weather")]
    assert parser.incomplete_calls == {1}


def test_arguments_stream_in_pieces_as_written():
    text = "<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Pa}ris\\"", "n": [1, {"a": 2}]}}' + "\n</tool_call>"
    parser = HermesToolCallParser()
    pieces = [piece for char in text for piece in parser.feed(char).calls] + parser.finish().calls
    first, *rest = pieces
    # announced with the arguments' first character, the one that completes its head
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{") and first.id.startswith("call_")
    assert all(p.id is None and p.name is None and len(p.arguments) == 1 for p in rest)
    arguments = "".join(p.arguments for p in pieces)
    assert arguments == '{"city": "Pa}ris\\"", "n": [1, {"a": 2}]}'
    assert json.loads(arguments) == {"city": 'Pa}ris"', "n": [1, {"a": 2}]}


def test_a_call_whose_head_does_not_stream_arrives_whole():
    text = '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>'
    content, calls, pieces = stream(text, list(range(len(text))))
    assert content == "" and len(pieces) == 1 and (calls[0].name, json.loads(calls[0].arguments)) == ("f", {"a": 1})


def test_an_announced_call_keeps_its_arguments_as_written():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'
    delta = parse_tool_calls(text)
    assert delta.content == "" and [(c.name, c.arguments) for c in delta.calls] == [("f", '{"a": }')]


def test_max_calls_keeps_the_first():
    delta = parse_tool_calls(WEATHER + TIME, max_calls=1)
    assert [c.name for c in delta.calls] == ["get_weather"]


def test_prefilled_start_of_a_call_is_completed_by_the_output():
    tail = '<tool_call>\n{"name": "get_weather", "arguments": '
    delta = parse_tool_calls('{"city": "Rome"}}\n</tool_call>', tail)
    assert calls_of(delta) == [(0, "get_weather", {"city": "Rome"})] and delta.content == ""


def test_prefilled_plain_text_is_not_echoed():
    assert parse_tool_calls(" more", "Some prefill").content == " more"


def test_partial_start_tag_is_held_back_then_released():
    parser = HermesToolCallParser()
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.feed("box> ok").content == " <toolbox> ok"


@pytest.mark.parametrize("text", [
    "Let me check.\n" + WEATHER + "\n" + TIME,
    "x " + MALFORMED + " y",
    WEATHER + " trailing",
    "plain text, with trailing space ",
])
def test_every_single_split_point_gives_the_whole_result(text):
    whole = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        content, calls, _ = stream(text, [cut])
        assert content == whole.content, cut
        assert [(c.index, c.name, c.arguments) for c in calls] == [(c.index, c.name, c.arguments) for c in whole.calls]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_split_into_many_pieces_gives_the_whole_result(data):
    pieces = data.draw(st.lists(st.sampled_from([WEATHER, TIME, MALFORMED, "text ", "\n", "<tool", "</tool_call>"]),
                                max_size=6))
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    whole = parse_tool_calls(text)
    content, calls, _ = stream(text, cuts)
    assert content == whole.content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
