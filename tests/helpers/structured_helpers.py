"""The formats the structured-output tests hold a tiny random model to (tests/engine, tests/server), and the check
that a text meets SCHEMA."""

from __future__ import annotations

import json

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'start: pair pair? pair? "!"\npair: "ab" | "cd"'  # Lark, llguidance's dialect
GBNF = 'root ::= pair pair? pair? "!"\npair ::= "ab" | "cd"'  # the same in GBNF (vLLM's xgrammar dialect)
GRAMMAR_REGEX = r"(ab|cd){1,3}!"


def conforms(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"color", "count"} and value["color"] in ("red", "green", "blue")
            and isinstance(value["count"], int) and 0 <= value["count"] <= 99)
