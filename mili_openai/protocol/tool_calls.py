"""Qwen3 (Hermes-style) tool calls, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: parsed
out of the output, and enforced by a grammar for `tool_choice` "required" or a named function.

The model writes each call as one JSON object between the tags, possibly several in a row. The
parser turns every well-formed block into an OpenAI tool call (`call_...` id, function name,
arguments as a JSON string) and leaves everything else as content:

- text outside the blocks stays content; whitespace that only separates blocks from each other or
  from the text around them is dropped (the template writes "\\n" around every block);
- a block whose JSON is malformed, or that lacks a string `name`, is returned as content verbatim:
  a bad generation is the model's answer, never a server error;
- a block still open when the output ends counts if its JSON is complete (the model may stop at EOS
  or a stop string instead of writing `</tool_call>`), as vLLM's Hermes parser does.

Streaming holds back text that could be the start of `<tool_call>` and buffers each block until it
closes, then emits the call. Emitting a call only once its JSON is known to be valid is what keeps
the streamed result identical to the non-streamed one, malformed blocks included; the cost is that
a call's arguments arrive in one piece instead of token by token.

`tool_choice: "required"` or a named function is enforced as vLLM does: a grammar (structured outputs)
makes the whole output tool calls, each call's arguments held to its function's JSON schema; the parser
then reads them back as it reads calls the model chose to make.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.structured_output import single_token_id
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.reasoning import partial_tag_length

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

CALL_ID_PREFIX = "call_"
CALL_ID_HEX_CHARS = 24


def new_call_id() -> str:
    return CALL_ID_PREFIX + uuid.uuid4().hex[:CALL_ID_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    index: int  # position among this choice's calls (the `index` of OpenAI's streamed tool-call deltas)
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class ToolParseDelta:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


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


class ToolCallStreamParser:
    """Feed content pieces; get content to show and completed tool calls back."""

    def __init__(self, max_calls: int | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false keeps only the first call
        self._make_id = make_id
        self._in_block = False
        self._buffer = ""  # outside: held text (tag prefix, trailing whitespace); inside: the block body
        self._after_block = False  # drop the whitespace that separates a block from what follows
        self._space_before_block = ""
        self.num_calls = 0  # well-formed calls seen (including any dropped by max_calls)

    def prime(self, text: str) -> None:
        """Advance over text that is already in the prompt (an assistant prefill); emits nothing.

        A block opened in the prefill and closed in the output is still returned as a call. Outside a
        block only a possible partial `<tool_call>` is kept: the prefill's own text is not re-emitted.
        """
        self.feed(text)
        if not self._in_block:
            self._buffer = self._buffer[len(self._buffer) - partial_tag_length(self._buffer, TOOL_CALL_START):]

    def feed(self, text: str) -> ToolParseDelta:
        self._buffer += text
        delta = ToolParseDelta()
        while self._buffer:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    break
                self._close_block(self._buffer[:end], delta)
                self._buffer = self._buffer[end + len(TOOL_CALL_END):]
                continue
            if self._after_block:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._after_block = False
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                # whitespace right before a block only separates it from the text (kept if the block
                # turns out malformed and is shown verbatim)
                before = self._buffer[:start]
                delta.content += before.rstrip()
                self._space_before_block = before[len(before.rstrip()):]
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._in_block = True
                continue
            held = partial_tag_length(self._buffer, TOOL_CALL_START)
            body = self._buffer[: len(self._buffer) - held]
            released = body.rstrip()  # trailing whitespace waits: a block may follow it
            delta.content += released
            self._buffer = self._buffer[len(released):]
            break
        return delta

    def finish(self) -> ToolParseDelta:
        """The output ended: close an open block if its JSON is complete, release held text."""
        delta = ToolParseDelta()
        held, self._buffer = self._buffer, ""
        if self._in_block:
            self._in_block = False
            if not self._accept(held, delta):
                delta.content += self._space_before_block + TOOL_CALL_START + held
        elif held.strip() or not self.num_calls:
            delta.content += held  # trailing whitespace is dropped only where it trails a call
        return delta

    def _close_block(self, body: str, delta: ToolParseDelta) -> None:
        self._in_block = False
        if self._accept(body, delta):
            self._after_block = True
        else:
            delta.content += self._space_before_block + TOOL_CALL_START + body + TOOL_CALL_END

    def _accept(self, body: str, delta: ToolParseDelta) -> bool:
        parsed = parse_call_block(body)
        if parsed is None:
            return False
        if self.max_calls is None or self.num_calls < self.max_calls:
            delta.calls.append(ParsedToolCall(self.num_calls, self._make_id(), *parsed))
        self.num_calls += 1
        return True


# ---- enforced calls ----
def tag_terminal(tokenizer: Any, tag: str) -> str:
    """A Lark terminal for a tag: the token itself where the vocabulary has it as one (llguidance sees
    such added tokens as special, not as their text), else the text."""
    token_id = single_token_id(tokenizer, tag)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(tag)


def tool_call_grammar(tokenizer: Any, tools: list[ToolDefinition], choice: str | NamedToolChoice,
                      parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or with `parallel` one or more, of the named
    function or, for "required", of any of `tools`."""
    functions = [tool.function for tool in tools
                 if not isinstance(choice, NamedToolChoice) or tool.function.name == choice.function.name]
    rules = []
    for index, function in enumerate(functions):
        schema = {
            "x-guidance": {"whitespace_flexible": False},  # compact: whitespace is where a model could loop
            "type": "object",
            "properties": {"name": {"const": function.name},
                           "arguments": function.parameters or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"call_{index}: %json {json.dumps(schema)}")
    start, end = tag_terminal(tokenizer, TOOL_CALL_START), tag_terminal(tokenizer, TOOL_CALL_END)
    bodies = " | ".join(f"call_{index}" for index in range(len(functions)))
    top = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([top, f'call: {start} "\\n" ({bodies}) "\\n" {end}', *rules])
