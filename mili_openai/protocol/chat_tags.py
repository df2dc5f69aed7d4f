"""The Qwen3 output tags the chat route parses, and the one string helper both parsers need.

Streaming parsers see text in arbitrary pieces, so a tag can arrive split (`<thi` + `nk>`). They hold
back the tail of their buffer that could still grow into a tag, and release it once it cannot.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# The rendered prompt's last assistant turn starts after this; what follows it (an opened `<think>`,
# an empty thinking block, a prefill) is the state the output continues from.
ASSISTANT_TURN_START = "<|im_start|>assistant\n"


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none).

    That suffix must be held back: the next piece may complete the tag.
    """
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
