"""One choice's output -> reasoning, content, tool calls; and chat logprobs with real token bytes."""

from __future__ import annotations

from helpers_server import qwen_tokenizer  # noqa: F401
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.protocol.logprobs import chat_logprobs, token_bytes
from mili_openai.protocol.chat_output import ChatOutputParser, OutputOptions, parse_whole_output
from mili_openai.protocol.tool_calls import merge_pieces

ALL_ON = OutputOptions(split_reasoning=True, include_reasoning=True, parse_tools=True, max_calls=None)
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def test_tool_calls_written_while_thinking_are_not_calls():
    text = f"<think>\nMaybe {CALL}?\n</think>\n\nDone."
    delta = parse_whole_output(text, "", ALL_ON)
    assert delta.reasoning == f"Maybe {CALL}?" and delta.content == "Done." and delta.calls == []


def test_call_after_thinking_is_parsed():
    delta = parse_whole_output(f"<think>\nI need f.\n</think>\n\n{CALL}", "", ALL_ON)
    assert delta.reasoning == "I need f." and delta.content == "" and [c.name for c in delta.calls] == ["f"]


def test_prefilled_call_after_a_closed_thinking_block_in_the_prompt():
    tail = '<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": '
    delta = parse_whole_output('{"x": 2}}\n</tool_call>', tail, ALL_ON)
    assert delta.reasoning == "" and [(c.name, c.arguments) for c in delta.calls] == [("f", '{"x": 2}')]


def test_streaming_matches_whole_at_every_split():
    text = f"<think>\nplan\n</think>\n\nSure.\n{CALL}\n{CALL}"
    whole = parse_whole_output(text, "", ALL_ON)
    for cut in range(len(text) + 1):
        parser = ChatOutputParser("", ALL_ON)
        first, second, end = parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()
        first.extend(second)
        first.extend(end)
        assert (first.reasoning, first.content) == (whole.reasoning, whole.content), cut
        assert [(c.index, c.arguments) for c in merge_pieces(first.calls)] == [(c.index, c.arguments)
                                                                              for c in whole.calls]
        assert parser.num_calls == 2


def test_without_tools_or_think_tags_the_text_passes_through():
    options = OutputOptions(split_reasoning=False, include_reasoning=True, parse_tools=False, max_calls=None)
    text = f"<think>x</think>{CALL}"
    delta = parse_whole_output(text, "", options)
    assert (delta.reasoning, delta.content, delta.calls) == ("", text, [])


def test_logprob_bytes_rebuild_multibyte_text(qwen_tokenizer):  # noqa: F811
    text = "héllo 世界 🙂 <think>"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(qwen_tokenizer, t) for t in ids) == text.encode()
    out = chat_logprobs(qwen_tokenizer, [TokenLogprob(t, -0.1, [(t, -0.1), (0, -2.0)]) for t in ids], top_k=1)
    assert bytes(b for entry in out.content for b in entry.bytes) == text.encode()
    assert all(len(entry.top_logprobs) == 1 for entry in out.content)
