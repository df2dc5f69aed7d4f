"""Hermes-style tool calls: several blocks, malformed JSON, text around calls, every split point."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mili_openai.protocol.tool_calls import ToolCallStreamParser, ToolParseDelta, parse_call_block


def parse_tool_calls(text: str, prompt_tail: str = "", max_calls: int | None = None) -> ToolParseDelta:
    """Whole-output form of the stream parser."""
    parser = ToolCallStreamParser(max_calls)
    parser.prime(prompt_tail)
    delta = parser.feed(text)
    end = parser.finish()
    return ToolParseDelta(delta.content + end.content, delta.calls + end.calls)


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'


def calls_of(delta):
    return [(c.index, c.name, json.loads(c.arguments)) for c in delta.calls]


def stream(text: str, cuts: list[int], max_calls: int | None = None, tail: str = ""):
    parser = ToolCallStreamParser(max_calls)
    parser.prime(tail)
    content, calls = "", []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        delta = parser.feed(text[start:end])
        content, calls = content + delta.content, calls + delta.calls
    delta = parser.finish()
    return content + delta.content, calls + delta.calls


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
    cut = WEATHER[:30]
    assert parse_tool_calls(cut).content == cut and parse_tool_calls(cut).calls == []


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
    parser = ToolCallStreamParser()
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
        content, calls = stream(text, [cut])
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
    content, calls = stream(text, cuts)
    assert content == whole.content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
