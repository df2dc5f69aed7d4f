"""Tool calls parsed out of a model's output as it writes them: the shapes every format shares, and the stream
parser around the `<tool_call>` ... `</tool_call>` blocks that Qwen models write them in.

Two formats fill those blocks (one file each, one parser class each):
- Hermes JSON, Qwen3's: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (hermes_tool_calls.py);
- XML, Qwen3.5's, Qwen3.6's and Qwen3-Coder's: `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n
  </function>\n</tool_call>`, vLLM's `qwen3_coder` (xml_tool_calls.py).
tool_call_parsers.py picks one for the model.

What the formats share, here:
- text outside the blocks stays content; whitespace that only separates blocks from each other or from the
  text around them is dropped (the templates write "\n" around every block);
- a block becomes an OpenAI tool call (`call_...` id, function name, arguments as JSON text). A stream
  announces the call (a first piece with its id and name) as soon as the block's head shows it is one, then
  sends its arguments in pieces; the pieces join to the whole output's `arguments`;
- a block that is not a call is returned as content verbatim: a bad generation is the model's answer, never a
  server error;
- a call still open when the output ends was cut (max_tokens) unless its format says it is complete. The
  stream cannot take back what it sent, so its arguments end where the output did (`incomplete_calls` says
  which), while the whole response leaves such a call out.

Everything depends only on the text, never on where a stream's pieces were cut.

`tool_choice: "required"` or a named function is enforced as vLLM does: a grammar (structured outputs) in the
format makes the whole output tool calls, each call's arguments held to its function's JSON schema; the parser
then reads them back as it reads calls the model chose to make. The grammars' shared parts are at the end.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.structured_output import single_token_id
from mili_openai.protocol.chat import FunctionDefinition, NamedToolChoice, ToolDefinition
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


@dataclass(frozen=True, slots=True)
class BlockClosed:
    rest: str  # the output after the block's `</tool_call>`
    verbatim: str | None = None  # the block was no call: its body, returned as content between the tags


class CallSink:
    """What a block reports its calls to (the parser): announcements, argument text, calls cut off."""

    def __init__(self, max_calls: int | None, make_id: Callable[[], str]) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false keeps only the first call
        self._make_id = make_id
        self.num_calls = 0  # calls seen (including any dropped by max_calls)
        self.incomplete_calls: set[int] = set()  # announced calls whose arguments never closed

    def announce(self, delta: ToolParseDelta, name: str, arguments: str = "") -> int:
        """A new call: its index, and its first piece (id, name, the first of its arguments) in `delta`."""
        index = self.num_calls
        self.num_calls += 1
        if self._keeps(index):
            delta.add_piece(index, arguments, self._make_id(), name)
        return index

    def send(self, delta: ToolParseDelta, index: int, arguments: str) -> None:
        if arguments and self._keeps(index):
            delta.add_piece(index, arguments)

    def _keeps(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls


class CallBlock(ABC):
    """One `<tool_call>` block being read (the text after its start tag), in one format."""

    @abstractmethod
    def read(self, text: str, delta: ToolParseDelta) -> BlockClosed | None:
        """Take the block's next text; calls and their pieces go to the sink and `delta`. Returns how the
        block closed once its `</tool_call>` is in, else None (everything taken)."""

    @abstractmethod
    def finish(self, delta: ToolParseDelta) -> str | None:
        """The output ended inside the block: report what it completed; the block's text if it shows as
        content, else None."""


class ToolCallStreamParser(ABC):
    """Feed content pieces; get content to show and tool-call pieces back. A format gives its blocks."""

    def __init__(self, max_calls: int | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        self.sink = CallSink(max_calls, make_id)
        self._block: CallBlock | None = None  # inside a block
        self._buffer = ""  # outside a block: held text (tag prefix, trailing whitespace)
        self._after_block = False  # drop the whitespace that separates a block from what follows
        self._space_before_block = ""
        self._primed = ToolParseDelta()  # pieces of a call the prefill already began, for the first delta

    @abstractmethod
    def _open_block(self) -> CallBlock:
        """A reader for the block that just opened."""

    @property
    def num_calls(self) -> int:
        return self.sink.num_calls

    @property
    def incomplete_calls(self) -> set[int]:
        return self.sink.incomplete_calls

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
                text, self._buffer = self._buffer, ""
                closed = self._block.read(text, delta)
                if closed is None:
                    break
                self._block, self._buffer = None, closed.rest
                self._close_block(closed.verbatim, delta)
                continue
            if self._after_block:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._after_block = False
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                # whitespace right before a block only separates it from the text (kept if the block
                # turns out not to be a call and is shown verbatim)
                before = self._buffer[:start]
                delta.content += before.rstrip()
                self._space_before_block = before[len(before.rstrip()):]
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._block = self._open_block()
                continue
            held = partial_tag_length(self._buffer, TOOL_CALL_START)
            body = self._buffer[: len(self._buffer) - held]
            released = body.rstrip()  # trailing whitespace waits: a block may follow it
            delta.content += released
            self._buffer = self._buffer[len(released):]
            break
        return delta

    def finish(self) -> ToolParseDelta:
        """The output ended: an open block reports what it completed; held text is released."""
        delta, self._primed = self._primed, ToolParseDelta()
        held, self._buffer = self._buffer, ""
        block, self._block = self._block, None
        if block is not None:
            verbatim = block.finish(delta)
            if verbatim is not None:
                delta.content += self._space_before_block + TOOL_CALL_START + verbatim
        elif held.strip() or not self.num_calls:
            delta.content += held  # trailing whitespace is dropped only where it trails a call
        return delta

    def _close_block(self, verbatim: str | None, delta: ToolParseDelta) -> None:
        if verbatim is None:
            self._after_block = True
        else:
            delta.content += self._space_before_block + TOOL_CALL_START + verbatim + TOOL_CALL_END


# ---- enforced calls: the grammars' shared parts (llguidance's Lark dialect) ----
def tag_terminal(tokenizer: Any, tag: str) -> str:
    """A Lark terminal for a tag: the token itself where the vocabulary has it as one (llguidance sees
    such added tokens as special, not as their text), else the text."""
    token_id = single_token_id(tokenizer, tag)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(tag)


def enforced_functions(tools: list[ToolDefinition], choice: str | NamedToolChoice) -> list[FunctionDefinition]:
    """The functions a "required" (any of `tools`) or named choice allows."""
    return [tool.function for tool in tools
            if not isinstance(choice, NamedToolChoice) or tool.function.name == choice.function.name]


def calls_rule(parallel: bool) -> str:
    """The start rule: one `call`, or with `parallel` one or more on their own lines."""
    return 'start: call ("\\n" call)*' if parallel else "start: call"
