"""Qwen3's Hermes-style tool calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: the
block reader, and the grammar that enforces calls for `tool_choice` "required" or a named function.

The model writes each call as one JSON object between the tags (the shared rules: tool_calls.py):
- a call streams as vLLM's Hermes parser streams it: once the block's head `{"name": "...", "arguments": {`
  is written, a first piece announces the call (id and name), then the arguments follow in pieces as they
  arrive, their text exactly as the model writes it;
- a block whose head is not that (the arguments first, or given as a JSON string) waits for its end and
  counts if it parses as a call; one that does not is returned as content verbatim;
- a block still open when the output ends counts if its JSON is complete (the model may stop at EOS or a
  stop string instead of writing `</tool_call>`), as vLLM's Hermes parser does; an incomplete one is cut.

`tool_choice: "required"` or a named function is enforced as vLLM does: a grammar (structured outputs) makes
the whole output tool calls, each call's arguments held to its function's JSON schema; the parser then reads
them back as it reads calls the model chose to make.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mili_openai.engine.structured_output import strict_json_schema
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.reasoning import partial_tag_length
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

# the head of a block that streams: its name, then the object its arguments are (group 1: the name as JSON)
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def parse_call_block(block: str) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of one block's body, or None if it is not a well-formed call."""
    try:
        payload = json.loads(block)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some generations double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return payload["name"], json.dumps(arguments, ensure_ascii=False)


def _json_string(text: str) -> str | None:
    try:
        return json.loads(text)
    except ValueError:  # an escape JSON does not have
        return None


class _JsonValueEnd:
    """Finds where a JSON object or array ends, fed its text in pieces (strings and escapes tracked)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def scan(self, text: str) -> int:
        """How much of `text` belongs to the value (all of it until the value closes)."""
        for position, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return position + 1
        return len(text)


class HermesBlock(CallBlock):
    """The call being written: its body so far and, once its head is in, its streamed arguments."""

    def __init__(self, sink: CallSink) -> None:
        self.sink = sink
        self.body = ""
        self.held = ""  # a possible partial `</tool_call>` at the end of what was read
        self.index: int | None = None  # set when the call is announced
        self.scanned = 0  # how far into `body` the arguments have been sent
        self.value = _JsonValueEnd()

    def read(self, text: str, delta: ToolParseDelta) -> BlockClosed | None:
        text, self.held = self.held + text, ""
        end = text.find(TOOL_CALL_END)
        readable = end if end >= 0 else len(text) - partial_tag_length(text, TOOL_CALL_END)
        self.body += text[:readable]
        self._stream(delta)
        if end < 0:
            self.held = text[readable:]
            return None
        rest = text[end + len(TOOL_CALL_END):]
        if self.index is not None:  # announced: a call, whatever follows its arguments
            if not self.value.done:
                self.sink.incomplete_calls.add(self.index)
            return BlockClosed(rest)
        return BlockClosed(rest) if self._accept(delta) else BlockClosed(rest, self.body)

    def finish(self, delta: ToolParseDelta) -> str | None:
        """An open block counts if its JSON is complete, else it is dropped."""
        if self.index is None:
            self._accept(delta)
        elif not self.value.done:
            self.sink.incomplete_calls.add(self.index)
        return None

    def _stream(self, delta: ToolParseDelta) -> None:
        """Announce the call once its head is in, then send the arguments written since the last piece."""
        if self.index is None:
            head = CALL_HEAD.match(self.body)
            name = _json_string(head.group(1)) if head is not None else None
            if not name:  # not yet, or not a head that streams: the block waits for its end
                return
            self.index, self.scanned = self.sink.announce(delta, name), head.end()
        if self.value.done:
            return
        new = self.body[self.scanned:]
        taken = self.value.scan(new)
        self.sink.send(delta, self.index, new[:taken])
        self.scanned += taken

    def _accept(self, delta: ToolParseDelta) -> bool:
        """A block that did not stream: one whole call if it parses as one."""
        parsed = parse_call_block(self.body)
        if parsed is None:
            return False
        self.sink.announce(delta, *parsed)
        return True


class HermesToolCallParser(ToolCallStreamParser):
    def _open_block(self) -> CallBlock:
        return HermesBlock(self.sink)


# ---- enforced calls ----
def hermes_call_grammar(tokenizer: Any, tools: list[ToolDefinition], choice: str | NamedToolChoice,
                        parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or with `parallel` one or more, of the named
    function or, for "required", of any of `tools`."""
    rules = []
    functions = enforced_functions(tools, choice)
    for index, function in enumerate(functions):
        schema = {
            "x-guidance": {"whitespace_flexible": False},  # compact: whitespace is where a model could loop
            "type": "object",
            "properties": {"name": {"const": function.name},
                           "arguments": strict_json_schema(function.parameters or {"type": "object"})},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"call_{index}: %json {json.dumps(schema)}")
    start, end = tag_terminal(tokenizer, TOOL_CALL_START), tag_terminal(tokenizer, TOOL_CALL_END)
    bodies = " | ".join(f"call_{index}" for index in range(len(functions)))
    return "\n".join([calls_rule(parallel), f'call: {start} "\\n" ({bodies}) "\\n" {end}', *rules])
