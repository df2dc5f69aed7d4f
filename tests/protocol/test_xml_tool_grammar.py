"""The grammar that enforces XML tool calls (tool_choice "required" or a named function), run by llguidance over
the Qwen3.5 vocabulary: it takes calls as the template writes them, values of the schema's types only, and what
it takes parses back into those calls."""

from __future__ import annotations

import json

import pytest

from mili_openai.engine.sampling_params import StructuredOutputsParams
from mili_openai.engine.structured_output import GrammarCompiler
from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.tool_calls import merge_pieces
from mili_openai.protocol.xml_tool_calls import XmlToolCallParser, xml_call_grammar

TOOLS = [ToolDefinition.model_validate(tool) for tool in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "hourly": {"type": "boolean"}, "unit": {"enum": ["c", "f"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        "note": {"type": ["integer", "null"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})


def call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", city="Paris </parameter> Nord\nCentre", days="3", scale="-1.5e2", hourly="true",
               unit="f", where='{"lat": 48.8}', note="null")


@pytest.fixture(scope="module")
def compiler(qwen35_tokenizer):
    return GrammarCompiler(qwen35_tokenizer, QWEN35_VOCAB_SIZE)


def accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar)).matcher
    return all(matcher.consume_token(token) for token in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


@pytest.mark.parametrize(("choice", "parallel", "text", "ok"), [
    ("required", False, WEATHER, True),
    ("required", False, call("get_weather", city="Oslo"), True),
    ("required", False, call("get_time"), True),
    ("required", True, WEATHER + "\n" + call("get_time"), True),
    ("required", False, WEATHER + "\n" + call("get_time"), False),  # one call only
    ("required", False, call("get_weather", days="3"), False),  # the required city is missing
    ("required", False, call("get_weather", city="Oslo", days="three"), False),
    ("required", False, call("get_weather", city="Oslo", hourly="True"), False),
    ("required", False, call("get_weather", city="Oslo", unit="k"), False),
    ("required", False, call("get_weather", city="Oslo", where='{"lon": 1}'), False),
    ("required", False, call("get_weather", city="Oslo", extra="1"), False),
    ("required", False, call("get_clock"), False),
    (NAMED, False, call("get_time"), True),
    (NAMED, False, call("get_weather", city="Oslo"), False),
    ("required", False, "Sure! " + call("get_time"), False),
])
def test_the_grammar_takes_calls_of_the_schemas_types_only(compiler, qwen35_tokenizer, choice, parallel,
                                                          text, ok):
    grammar = xml_call_grammar(qwen35_tokenizer, TOOLS, choice, parallel)
    assert accepts(compiler, qwen35_tokenizer, grammar, text) is ok


def test_what_the_grammar_takes_parses_back_to_typed_arguments():
    parser = XmlToolCallParser(TOOLS)
    delta, end = parser.feed(WEATHER), parser.finish()
    (parsed,) = merge_pieces(delta.calls + end.calls)
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", {
        "city": "Paris </parameter> Nord\nCentre", "days": 3, "scale": -150.0, "hourly": True, "unit": "f",
        "where": {"lat": 48.8}, "note": None})
