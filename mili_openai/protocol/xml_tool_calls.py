"""Qwen3.5's, Qwen3.6's and Qwen3-Coder's XML tool calls, the format vLLM's `qwen3_coder` parser reads:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

The shared rules are in tool_calls.py. This format's:
- the head is `<function=NAME>` (after optional whitespace): once it is in, the call is announced and its
  arguments start (`{`). A block that opens with anything else, or a name with a space, quote, brace or angle
  bracket in it, is no call: its text is shown verbatim (a closed block as content; an open one at the end too);
- each parameter is sent once whole, as `"P": value` (JSON, pieces joined by ", "), so the arguments stream
  parameter by parameter and join to `json.dumps` of the object. A value is the text between the tags less
  one newline at each end. A `</parameter>` inside a value (code that writes the tag) does not end it: only one
  followed by the next `<parameter=`, `</function>` or `</tool_call>`, or by the end of the output, does;
- `</function>` (or `</tool_call>` with it missing) closes the arguments (`}`): the call is complete. Text
  between the parameters, or after `</function>`, is not part of the call and is dropped;
- the output ending before that cuts the call (the shared rule).

Values are typed by the function's JSON schema, as vLLM's parser does: `integer`, `number` and `boolean` when
the text is one (booleans in any case: the template writes Python's `True`), `object` / `array` when it is that
JSON, null (`null`, or Python's `None` the template writes) where the schema admits null; otherwise, and for
parameters the schema does not declare, the value stays a string. The first of several types (`anyOf`, a type
list) that the text is wins.

The grammar for `tool_choice` "required" or a named function writes the calls as the template does, the
function's parameters in the schema's order (the required ones always), each value as its type: digits for an
integer, a JSON number, `true` / `false`, JSON held to the schema for an object or array, one of an enum's
strings, `null` where admitted, and for a string any text up to the `\n</parameter>\n` that ends it.
"""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

from mili_openai.engine.structured_output import strict_json_schema
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.tool_calls import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    BlockClosed,
    CallBlock,
    CallSink,
    ToolCallStreamParser,
    ToolParseDelta,
    calls_rule,
    enforced_functions,
    tag_terminal,
)

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
TAG_CLOSE = ">"
# a function name holds none of these (a stray template, pseudo-XML or prose is no call)
NAME_FORBIDDEN = frozenset("{}<>\"' \t\r\n")
# what may follow a `</parameter>` that ends a value (after whitespace)
VALUE_FOLLOWERS = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
NULL_WORDS = frozenset({"null", "none"})
INTEGER = re.compile(r"[-+]?\d+")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
JSON_TYPES = {"object": dict, "array": list}
# the grammar's values, by schema type (llguidance's Lark dialect)
VALUE_TERMINALS = {"integer": "/-?[0-9]+/", "number": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
                   "boolean": '("true" | "false")', "null": '"null"'}
VALUE_END = "\n" + PARAMETER_END + "\n"


# ---- values typed by the schema ----
def schema_types(schema: Any) -> list[str]:
    """The types a property's schema names, in order (`type` as a string or list, else its anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [kind for kind in declared if isinstance(kind, str)]
    return [kind for option in schema.get("anyOf", schema.get("oneOf", [])) for kind in schema_types(option)]


def _as_type(text: str, kind: str) -> tuple[bool, Any]:
    """`(True, value)` if the text is a `kind`, else `(False, None)`."""
    stripped = text.strip()
    if kind == "integer" and INTEGER.fullmatch(stripped):
        return True, int(stripped)
    if kind == "number" and NUMBER.fullmatch(stripped):
        number = float(stripped)
        if math.isfinite(number):
            return True, int(stripped) if INTEGER.fullmatch(stripped) else number
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return True, stripped.lower() == "true"
    if kind in JSON_TYPES:
        try:
            value = json.loads(stripped)
        except ValueError:
            return False, None
        return isinstance(value, JSON_TYPES[kind]), value
    return False, None


def typed_value(text: str, schema: Any) -> Any:
    """The parameter's value as its schema types it; the text itself where it is no such value."""
    kinds = schema_types(schema)
    if "null" in kinds and text.strip().lower() in NULL_WORDS:  # before "string": a nullable string's null
        return None
    for kind in kinds:
        if kind == "string":
            return text
        matched, value = _as_type(text, kind)
        if matched:
            return value
    return text


def parameter_schemas(tools: list[ToolDefinition] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' schemas by name."""
    schemas = {}
    for tool in tools or []:
        properties = (tool.function.parameters or {}).get("properties")
        schemas[tool.function.name] = properties if isinstance(properties, dict) else {}
    return schemas


# ---- the block reader ----
class _Part(enum.Enum):
    HEAD = "head"  # before `<function=NAME>`
    NOT_A_CALL = "not a call"  # waiting for `</tool_call>` to show the block as text
    BETWEEN = "between"  # between parameters
    VALUE = "value"  # inside a parameter's value
    CLOSED = "closed"  # after `</function>`, until `</tool_call>`


def _first_of(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str]:
    """`(position, tag)` of the first of `tags` in `text` from `start`; (-1, "") if none."""
    found = [(position, tag) for tag in tags if (position := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, "")


class XmlBlock(CallBlock):
    def __init__(self, sink: CallSink, schemas: dict[str, dict[str, Any]]) -> None:
        self.sink = sink
        self.schemas = schemas
        self.body = ""  # the block's text so far
        self.position = 0  # how far into `body` has been read
        self.part = _Part.HEAD
        self.index: int | None = None  # the call's, once announced
        self.parameters: dict[str, Any] = {}  # the function's parameter schemas
        self.sent_parameters = 0
        self.parameter = ""  # the name of the value being read
        self.value_start = 0

    def read(self, text: str, delta: ToolParseDelta) -> BlockClosed | None:
        self.body += text
        return self._advance(delta, final=False)

    def finish(self, delta: ToolParseDelta) -> str | None:
        self._advance(delta, final=True)
        if self.part in (_Part.HEAD, _Part.NOT_A_CALL):
            return self.body if self.part is _Part.NOT_A_CALL else None
        if self.part is not _Part.CLOSED:
            self.sink.incomplete_calls.add(self.index)
        return None

    def _advance(self, delta: ToolParseDelta, final: bool) -> BlockClosed | None:
        """Read as far as the text decides; a closed block's remainder."""
        while True:
            if self.part is _Part.HEAD:
                progressed = self._read_head(delta)
            elif self.part is _Part.NOT_A_CALL or self.part is _Part.CLOSED:
                end = self.body.find(TOOL_CALL_END, self.position)
                if end < 0:
                    self.position = max(self.position, len(self.body) - len(TOOL_CALL_END) + 1)
                    return None
                verbatim = self.body[:end] if self.part is _Part.NOT_A_CALL else None
                return BlockClosed(self.body[end + len(TOOL_CALL_END):], verbatim)
            elif self.part is _Part.BETWEEN:
                progressed = self._read_between(delta)
            else:
                progressed = self._read_value(delta, final)
            if not progressed:
                return None

    def _read_head(self, delta: ToolParseDelta) -> bool:
        text = self.body.lstrip()
        skipped = len(self.body) - len(text)
        if not text.startswith(FUNCTION_START):
            if not FUNCTION_START.startswith(text):
                self.part = _Part.NOT_A_CALL
            return self.part is _Part.NOT_A_CALL
        name_start = skipped + len(FUNCTION_START)
        name_end = self.body.find(TAG_CLOSE, name_start)
        name = self.body[name_start: name_end if name_end >= 0 else len(self.body)]
        if any(char in NAME_FORBIDDEN for char in name) or (name_end >= 0 and not name):
            self.part = _Part.NOT_A_CALL
            return True
        if name_end < 0:
            return False
        self.index = self.sink.announce(delta, name, "{")
        self.parameters = self.schemas.get(name, {})
        self.part, self.position = _Part.BETWEEN, name_end + len(TAG_CLOSE)
        return True

    def _read_between(self, delta: ToolParseDelta) -> bool:
        position, tag = _first_of(self.body, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END), self.position)
        if tag == PARAMETER_START:
            name_end = self.body.find(TAG_CLOSE, position + len(PARAMETER_START))
            if name_end < 0:
                return False
            self.parameter = self.body[position + len(PARAMETER_START): name_end]
            self.part, self.value_start = _Part.VALUE, name_end + len(TAG_CLOSE)
            self.position = self.value_start
            return True
        if not tag:
            return False
        self.sink.send(delta, self.index, "}")
        # a missing `</function>` leaves `</tool_call>` to close the call and the block at once
        self.part, self.position = _Part.CLOSED, position + (len(FUNCTION_END) if tag == FUNCTION_END else 0)
        return True

    def _read_value(self, delta: ToolParseDelta, final: bool) -> bool:
        """Find the `</parameter>` that ends the value (one that text after it decides, or the output's end)."""
        while True:
            end = self.body.find(PARAMETER_END, self.position)
            if end < 0:
                self.position = max(self.position, len(self.body) - len(PARAMETER_END) + 1)
                return False
            after = self.body[end + len(PARAMETER_END):].lstrip()
            if after.startswith(VALUE_FOLLOWERS) or (final and not after):
                break
            if not after or any(tag.startswith(after) for tag in VALUE_FOLLOWERS):
                self.position = end  # undecided until more text comes
                return False
            self.position = end + 1  # a `</parameter>` inside the value
        value = self.body[self.value_start: end]
        value = value.removeprefix("\n").removesuffix("\n")
        typed = typed_value(value, self.parameters.get(self.parameter))
        separator = ", " if self.sent_parameters else ""
        self.sink.send(delta, self.index, f"{separator}{json.dumps(self.parameter, ensure_ascii=False)}: "
                                          f"{json.dumps(typed, ensure_ascii=False)}")
        self.sent_parameters += 1
        self.part, self.position = _Part.BETWEEN, end + len(PARAMETER_END)
        return True


class XmlToolCallParser(ToolCallStreamParser):
    """The XML format's parser; `tools` type the parameter values."""

    def __init__(self, tools: list[ToolDefinition] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.schemas = parameter_schemas(tools)

    def _open_block(self) -> CallBlock:
        return XmlBlock(self.sink, self.schemas)


# ---- enforced calls ----
def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value_rule(rule: str, schema: Any) -> tuple[str, bool]:
    """`(rule text, whether it ends the value itself)`: a string's text runs to the value's end tag."""
    kinds = schema_types(schema)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(option, str) for option in enum):
        return f"{rule}: {' | '.join(_literal(option) for option in enum)}", False
    if not kinds or "string" in kinds or not set(kinds) <= {*VALUE_TERMINALS, *JSON_TYPES}:
        return f"{rule}[suffix={_literal(VALUE_END)}]: /(.|\\n)*/", True
    options = []
    for kind in kinds:
        if kind in JSON_TYPES:
            options.append(f"%json {json.dumps(strict_json_schema({**schema, 'type': kind}))}")
        else:
            options.append(VALUE_TERMINALS[kind])
    return f"{rule}: {' | '.join(options)}", False


def _call_rules(index: int, name: str, parameters: dict[str, Any]) -> list[str]:
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = set(parameters.get("required") or [])
    parts, rules = [], []
    for number, (parameter, schema) in enumerate(properties.items()):
        value, ends_itself = _value_rule(f"c{index}_v{number}", schema)
        end = "" if ends_itself else f" {_literal(VALUE_END)}"
        rules += [f"c{index}_p{number}: {_literal(PARAMETER_START + parameter + TAG_CLOSE + chr(10))} "
                  f"c{index}_v{number}{end}", value]
        parts.append(f"c{index}_p{number}" + ("" if parameter in required else "?"))
    head = _literal(f"\n{FUNCTION_START}{name}{TAG_CLOSE}\n")
    return [f"c{index}: {head} {' '.join(parts)} {_literal(FUNCTION_END + chr(10))}", *rules]


def xml_call_grammar(tokenizer: Any, tools: list[ToolDefinition], choice: str | NamedToolChoice,
                     parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or with `parallel` one or more, of the named
    function or, for "required", of any of `tools`, written as the template writes calls."""
    functions = enforced_functions(tools, choice)
    rules = [rule for index, function in enumerate(functions)
             for rule in _call_rules(index, function.name, function.parameters or {})]
    start, end = tag_terminal(tokenizer, TOOL_CALL_START), tag_terminal(tokenizer, TOOL_CALL_END)
    bodies = " | ".join(f"c{index}" for index in range(len(functions)))
    return "\n".join([calls_rule(parallel), f"call: {start} ({bodies}) {end}", *rules])
