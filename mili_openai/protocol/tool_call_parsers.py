"""Which tool-call format a model writes, and its parser: vLLM's `--tool-call-parser` names.

- "hermes": Qwen3's JSON in `<tool_call>` tags (hermes_tool_calls.py);
- "qwen3_coder": the XML of Qwen3.5, Qwen3.6 and Qwen3-Coder (xml_tool_calls.py).

The model's chat template says which: a template that teaches `<function=NAME>` is the XML one. The server's
`--tool-call-parser` overrides that (a checkpoint with a custom template).
"""

from __future__ import annotations

from typing import Any

from mili_openai.config import HERMES_TOOL_PARSER, XML_TOOL_PARSER
from mili_openai.protocol.chat import NamedToolChoice, ToolDefinition
from mili_openai.protocol.hermes_tool_calls import HermesToolCallParser, hermes_call_grammar
from mili_openai.protocol.tool_calls import ToolCallStreamParser
from mili_openai.protocol.xml_tool_calls import FUNCTION_START, XmlToolCallParser, xml_call_grammar


def template_tool_parser(chat_template: Any) -> str:
    """The parser a chat template's tool-call format needs (Hermes where the template says nothing)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]  # named templates
    teaches_xml = any(isinstance(template, str) and FUNCTION_START in template for template in templates)
    return XML_TOOL_PARSER if teaches_xml else HERMES_TOOL_PARSER


def model_tool_parser(override: str | None, tokenizer: Any) -> str:
    """The configured parser, else the one the tokenizer's chat template needs."""
    return override if override is not None else template_tool_parser(getattr(tokenizer, "chat_template", None))


def make_tool_parser(name: str, tools: list | None, max_calls: int | None) -> ToolCallStreamParser:
    if name == XML_TOOL_PARSER:
        return XmlToolCallParser(tools, max_calls=max_calls)
    if name == HERMES_TOOL_PARSER:
        return HermesToolCallParser(max_calls=max_calls)
    raise ValueError(f"unknown tool-call parser {name!r}")


def tool_call_grammar(name: str, tokenizer: Any, tools: list[ToolDefinition], choice: str | NamedToolChoice,
                      parallel: bool) -> str:
    """The grammar that holds the output to calls, for `tool_choice` "required" or a named function."""
    grammar = {HERMES_TOOL_PARSER: hermes_call_grammar, XML_TOOL_PARSER: xml_call_grammar}[name]
    return grammar(tokenizer, tools, choice, parallel)
