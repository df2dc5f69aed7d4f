"""One choice's output text -> reasoning, content and tool calls, streamed or whole.

The text goes through the reasoning split first; only the answer part is searched for tool calls
(a model may well mention `<tool_call>` while thinking). Both parsers start from the assistant
turn the prompt already opened (`RenderedPrompt.assistant_tail`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mili_openai.config import HERMES_TOOL_PARSER
from mili_openai.protocol.chat import ToolDefinition
from mili_openai.protocol.reasoning import THINK_END, ReasoningStreamParser
from mili_openai.protocol.tool_call_parsers import make_tool_parser
from mili_openai.protocol.tool_calls import ParsedToolCall, ToolCallPiece, append_piece, merge_pieces


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallPiece] = field(default_factory=list)  # pieces of calls, as a stream sends them

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for piece in other.calls:
            append_piece(self.calls, piece)


@dataclass(frozen=True, slots=True)
class OutputOptions:
    split_reasoning: bool  # the model has `<think>` tags (Qwen3)
    include_reasoning: bool  # false: reasoning is parsed out and dropped
    parse_tools: bool  # tool_choice is not "none" and tools were given
    max_calls: int | None  # 1 when parallel_tool_calls is false
    tool_parser: str = HERMES_TOOL_PARSER  # the format the model writes calls in (protocol/tool_call_parsers.py)
    tools: list[ToolDefinition] | None = None  # the request's: their schemas type the XML format's values


class ChatOutputParser:
    def __init__(self, assistant_tail: str, options: OutputOptions) -> None:
        self.options = options
        self._reasoning = ReasoningStreamParser() if options.split_reasoning else None
        self._tools = (make_tool_parser(options.tool_parser, options.tools, options.max_calls)
                       if options.parse_tools else None)
        if self._reasoning is not None:
            self._reasoning.prime(assistant_tail)
            # only the answer part of the prefill can hold a tool call
            answer_tail = "" if self._reasoning.in_reasoning else assistant_tail.rsplit(THINK_END, 1)[-1]
        else:
            answer_tail = assistant_tail
        if self._tools is not None:
            self._tools.prime(answer_tail)
        self.num_calls = 0  # calls announced so far (the finish reason becomes "tool_calls")

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._answer("", text, final=False)
        reasoning, content = self._reasoning.feed(text)
        return self._answer(reasoning, content, final=False)

    def finish(self) -> ChatDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        delta = ChatDelta(reasoning=reasoning if self.options.include_reasoning else "")
        if self._tools is None:
            delta.content = content
        else:
            parsed = self._tools.feed(content)
            if final:
                end = self._tools.finish()
                parsed.content += end.content
                for piece in end.calls:
                    append_piece(parsed.calls, piece)
            delta.content, delta.calls = parsed.content, parsed.calls
        self.num_calls += sum(piece.id is not None for piece in delta.calls)
        return delta

    @property
    def incomplete_calls(self) -> set[int]:
        """Calls whose arguments the output cut off (a stream has announced them already)."""
        return self._tools.incomplete_calls if self._tools is not None else set()


@dataclass(slots=True)
class WholeOutput:
    reasoning: str
    content: str
    calls: list[ParsedToolCall]


def parse_whole_output(text: str, assistant_tail: str, options: OutputOptions) -> WholeOutput:
    """The non-streaming form: one feed, then finish; calls whose arguments were cut off are left out."""
    parser = ChatOutputParser(assistant_tail, options)
    delta = parser.feed(text)
    delta.extend(parser.finish())
    return WholeOutput(delta.reasoning, delta.content, merge_pieces(delta.calls, parser.incomplete_calls))
