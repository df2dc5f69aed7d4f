"""Qwen3 thinking split: text inside `<think>...</think>` is reasoning, the rest is the answer.

`<think>` and `</think>` are *not* special tokens in the Qwen3 and Qwen3.5 vocabularies (added tokens
with `special: false`: 151667/151668, 248068/248069), so `skip_special_tokens=True` keeps them in the
decoded text and the parser can work on text deltas.

Where the output starts matters: the Qwen3 template renders `<think>\\n\\n</think>\\n\\n` into the
prompt when `enable_thinking` is false (the output is then all answer), and newer Qwen3 thinking
templates and Qwen3.5's (thinking by default) end the prompt with `<think>\\n`, so the output begins
*inside* the block and contains only `</think>`. The route therefore primes the parser with the prompt's
assistant-turn tail (`prime`), and the parser continues from the state that text leaves it in. Without
priming, an output that starts with `<think>` (after optional whitespace) opens the block; anything
else is answer.
"""

from __future__ import annotations

import enum

THINK_START = "<think>"
THINK_END = "</think>"
# Leading whitespace is held while a `<think>` may still follow it; past this much the output is
# taken as a plain answer, so a model that starts with a run of newlines still streams.
MAX_LEADING_WHITESPACE = 64


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none).

    Streaming parsers see text in arbitrary pieces, so a tag can arrive split (`<thi` + `nk>`): they
    hold back that suffix, which the next piece may complete, and release it once it cannot.
    """
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: a `<think>` here opens the reasoning block
    REASONING = "reasoning"  # inside the block, until `</think>`
    CONTENT = "content"  # the answer: passed through untouched


class ReasoningStreamParser:
    """Feed text pieces; get `(reasoning_delta, content_delta)` back, robust to tags split anywhere."""

    def __init__(self) -> None:
        self._state = _State.START
        self._buffer = ""  # held-back text that may still turn out to be (part of) a tag
        self._strip_newlines = False  # the answer after `</think>` starts after the template's "\n\n"

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    @property
    def at_start(self) -> bool:
        """Nothing but whitespace seen: a `<think>` may still open a block."""
        return self._state is _State.START

    def prime(self, text: str) -> None:
        """Advance the state over text that is already in the prompt; nothing of it is emitted."""
        self.feed(text)

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buffer:
            if self._strip_newlines:  # a block boundary: the template puts newlines after each tag
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    break
                self._strip_newlines = False
            if self._state is _State.START:
                stripped = self._buffer.lstrip()
                if len(self._buffer) - len(stripped) > MAX_LEADING_WHITESPACE:
                    self._state = _State.CONTENT
                elif stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START):]
                    self._state = _State.REASONING
                    self._strip_newlines = True
                elif THINK_START.startswith(stripped):  # whitespace, or a tag still arriving
                    break
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._buffer.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._buffer[:end].rstrip("\n"))
                    self._buffer = self._buffer[end + len(THINK_END):]
                    self._state = _State.CONTENT
                    self._strip_newlines = True
                else:
                    # hold a possible partial `</think>` and the newlines before it (dropped if the
                    # tag follows, so reasoning never ends with the template's "\n")
                    held = partial_tag_length(self._buffer, THINK_END)
                    released = self._buffer[: len(self._buffer) - held].rstrip("\n")
                    reasoning.append(released)
                    self._buffer = self._buffer[len(released):]
                    break
            else:
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: release what was held back as what it turned out to be."""
        held, self._buffer = self._buffer, ""
        if self._state is _State.REASONING:
            return held, ""
        if self._state is _State.START:
            self._state = _State.CONTENT
        return "", held


def output_reasoning_mode(prompt_tail: str) -> str:
    """How an output after `prompt_tail` may reason, as `StructuredOutputsParams.reasoning` takes it:
    "optional" (it may open a `<think>` block), "open" (it starts inside one) or "off" (it is all answer)."""
    parser = ReasoningStreamParser()
    parser.prime(prompt_tail)
    if parser.in_reasoning:
        return "open"
    return "optional" if parser.at_start else "off"
