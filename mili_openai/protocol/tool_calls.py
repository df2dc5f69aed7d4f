"""Qwen3 (Hermes-style) tool calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: parsed
out of the output as the model writes them, and enforced by a grammar for `tool_choice` "required" or a
named function.

The model writes each call as one JSON object between the tags, possibly several in a row. The parser
turns each block into an OpenAI tool call (`call_...` id, function name, arguments as JSON text) and
leaves everything else as content:

- text outside the blocks stays content; whitespace that only separates blocks from each other or
  from the text around them is dropped (the template writes "\n" around every block);
- a call streams as vLLM's Hermes parser streams it: once the block's head `{"name": "...",
  "arguments": {` is written, a first piece announces the call (id and name), then the arguments follow
  in pieces as they arrive, their text exactly as the model writes it (the pieces join to the whole
  output's `arguments`);
- a block whose head is not that (the arguments first, or given as a JSON string) waits for its end and
  counts if it parses as a call; one that does not is returned as content verbatim: a bad generation is
  the model's answer, never a server error;
- a block still open when the output ends counts if its JSON is complete (the model may stop at EOS or
  a stop string instead of writing `</tool_call>`), as vLLM's Hermes parser does. An incomplete one (the
  output cut by max_tokens) is dropped, never shown as content. Streamed, its call may have been
  announced already: the stream cannot take back what it sent, so its arguments end where the output
  did (`incomplete_calls` says which), while the whole response leaves such a call out.

Everything above depends only on the text, never on where a stream's pieces were cut: the pieces of a
stream join to the whole output's result.

`tool_choice: "required"` or a named function is enforced as vLLM does: a grammar (structured outputs)
makes the whole output tool calls, each call's arguments held to its function's JSON schema; the parser
then reads them back as it reads calls the model chose to make.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.structured_output import single_token_id, strict_json_schema
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.reasoning import partial_tag_length

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

CALL_ID_PREFIX = "call_"
CALL_ID_HEX_CHARS = 24
# the head of a block that streams: its name, then the object its arguments are (group 1: the name as JSON)
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def new_call_id() -> str:
    return CALL_ID_PREFIX + uuid.uuid4().hex[:CALL_ID_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    index: int  # position among this choice's calls (the `index` of OpenAI's streamed tool-call deltas)
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class ToolCallPiece:
    """Part of a call, as a stream sends it: the first piece of a call carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ToolParseDelta:
    content: str = ""
    calls: list[ToolCallPiece] = field(default_factory=list)

    def add_piece(self, index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> None:
        append_piece(self.calls, ToolCallPiece(index, arguments, call_id, name))


def append_piece(pieces: list[ToolCallPiece], piece: ToolCallPiece) -> None:
    """Append a piece, merged into the last one when it continues the same call."""
    if pieces and pieces[-1].index == piece.index and piece.id is None:
        pieces[-1].arguments += piece.arguments
    else:
        pieces.append(ToolCallPiece(piece.index, piece.arguments, piece.id, piece.name))


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


def merge_pieces(pieces: list[ToolCallPiece], dropped: set[int] = frozenset()) -> list[ParsedToolCall]:
    """The whole calls the pieces of a stream make up, less those in `dropped`."""
    calls: dict[int, ParsedToolCall] = {}
    for piece in pieces:
        if piece.index in dropped:
            continue
        call = calls.get(piece.index)
        if call is None:
            calls[piece.index] = ParsedToolCall(piece.index, piece.id or "", piece.name or "", piece.arguments)
        else:
            calls[piece.index] = ParsedToolCall(call.index, call.id, call.name, call.arguments + piece.arguments)
    return list(calls.values())


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


@dataclass(slots=True)
class _Block:
    """The call being written: its body so far and, once its head is in, its streamed arguments."""

    body: str = ""
    index: int | None = None  # set when the call is announced
    scanned: int = 0  # how far into `body` the arguments have been sent
    value: _JsonValueEnd = field(default_factory=_JsonValueEnd)


class ToolCallStreamParser:
    """Feed content pieces; get content to show and tool-call pieces back."""

    def __init__(self, max_calls: int | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false keeps only the first call
        self._make_id = make_id
        self._block: _Block | None = None  # inside a block
        self._buffer = ""  # outside a block: held text (tag prefix, trailing whitespace); inside: unread text
        self._after_block = False  # drop the whitespace that separates a block from what follows
        self._space_before_block = ""
        self._primed = ToolParseDelta()  # pieces of a call the prefill already began, for the first delta
        self.num_calls = 0  # calls seen (including any dropped by max_calls)
        self.incomplete_calls: set[int] = set()  # announced calls whose arguments never closed

    def prime(self, text: str) -> None:
        """Advance over text that is already in the prompt (an assistant prefill); emits no content.

        A block opened in the prefill and closed in the output is still returned as a call (with the part
        of its arguments the prefill wrote). Outside a block only a possible partial `<tool_call>` is kept:
        the prefill's own text is not re-emitted.
        """
        self._primed.calls = self.feed(text).calls
        if self._block is None:
            self._buffer = self._buffer[len(self._buffer) - partial_tag_length(self._buffer, TOOL_CALL_START):]

    def feed(self, text: str) -> ToolParseDelta:
        self._buffer += text
        delta, self._primed = self._primed, ToolParseDelta()
        while self._buffer:
            if self._block is not None:
                end = self._buffer.find(TOOL_CALL_END)
                readable = end if end >= 0 else len(self._buffer) - partial_tag_length(self._buffer, TOOL_CALL_END)
                self._block.body += self._buffer[:readable]
                self._buffer = self._buffer[readable:]
                self._stream_block(delta)
                if end < 0:
                    break
                self._buffer = self._buffer[len(TOOL_CALL_END):]
                self._close_block(delta)
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
                self._block = _Block()
                continue
            held = partial_tag_length(self._buffer, TOOL_CALL_START)
            body = self._buffer[: len(self._buffer) - held]
            released = body.rstrip()  # trailing whitespace waits: a block may follow it
            delta.content += released
            self._buffer = self._buffer[len(released):]
            break
        return delta

    def finish(self) -> ToolParseDelta:
        """The output ended: an open block counts if its JSON is complete, else it is dropped; held text
        is released."""
        delta, self._primed = self._primed, ToolParseDelta()
        held, self._buffer = self._buffer, ""
        block, self._block = self._block, None
        if block is not None:
            if block.index is not None:
                if not block.value.done:
                    self.incomplete_calls.add(block.index)
            else:
                self._accept(block.body, delta)
        elif held.strip() or not self.num_calls:
            delta.content += held  # trailing whitespace is dropped only where it trails a call
        return delta

    def _stream_block(self, delta: ToolParseDelta) -> None:
        """Announce the call once its head is in, then send the arguments written since the last piece."""
        block = self._block
        if block.index is None:
            head = CALL_HEAD.match(block.body)
            name = _json_string(head.group(1)) if head is not None else None
            if not name:  # not yet, or not a head that streams: the block waits for its end
                return
            block.index, block.scanned = self._new_call(), head.end()
            if self._keeps(block.index):
                delta.add_piece(block.index, "", self._make_id(), name)
        if block.value.done:
            return
        new = block.body[block.scanned:]
        taken = block.value.scan(new)
        if self._keeps(block.index) and taken:
            delta.add_piece(block.index, new[:taken])
        block.scanned += taken

    def _close_block(self, delta: ToolParseDelta) -> None:
        block, self._block = self._block, None
        if block.index is not None:  # announced: a call, whatever follows its arguments
            if not block.value.done:
                self.incomplete_calls.add(block.index)
            self._after_block = True
        elif self._accept(block.body, delta):
            self._after_block = True
        else:
            delta.content += self._space_before_block + TOOL_CALL_START + block.body + TOOL_CALL_END

    def _accept(self, body: str, delta: ToolParseDelta) -> bool:
        """A block that did not stream: one whole call if it parses as one."""
        parsed = parse_call_block(body)
        if parsed is None:
            return False
        index = self._new_call()
        if self._keeps(index):
            delta.add_piece(index, parsed[1], self._make_id(), parsed[0])
        return True

    def _new_call(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def _keeps(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls


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
                           "arguments": strict_json_schema(function.parameters or {"type": "object"})},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"call_{index}: %json {json.dumps(schema)}")
    start, end = tag_terminal(tokenizer, TOOL_CALL_START), tag_terminal(tokenizer, TOOL_CALL_END)
    bodies = " | ".join(f"call_{index}" for index in range(len(functions)))
    top = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([top, f'call: {start} "\\n" ({bodies}) "\\n" {end}', *rules])
