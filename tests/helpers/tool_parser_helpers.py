"""Feeding a tool-call stream parser (Hermes or XML) a model's output in pieces, as the routes do."""

from __future__ import annotations


def feed_in_pieces(parser, text: str, cuts: list[int]) -> tuple[str, list]:
    """(the content, every call piece, the finish's included) of `text` fed to `parser` cut at `cuts`."""
    content, pieces = "", []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        delta = parser.feed(text[start:end])
        content, pieces = content + delta.content, pieces + delta.calls
    delta = parser.finish()
    return content + delta.content, pieces + delta.calls
