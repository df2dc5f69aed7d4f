"""`tool_choice: "required"` or a named function, enforced as vLLM does: a grammar (structured outputs)
that makes the whole output Qwen3 tool calls, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
each call's arguments held to its function's JSON schema. The chat route's tool parser then reads them
back as it reads calls the model chose to make."""

from __future__ import annotations

import json
from typing import Any

from mili_openai.engine.structured_output import single_token_id
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.chat_tags import TOOL_CALL_END, TOOL_CALL_START


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
