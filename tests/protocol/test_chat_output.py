"""One choice's output -> reasoning, content, tool calls; and chat logprobs with real token bytes."""

from __future__ import annotations

import orjson
import pytest
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.protocol.chat import ChoiceLogprobs, TokenLogprobOut, TopLogprob
from mili_openai.protocol.logprobs import TokenPieces, chat_logprobs_object, token_bytes
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


def test_logprob_bytes_rebuild_multibyte_text(qwen_tokenizer):
    text = "héllo 世界 🙂 <think>"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(qwen_tokenizer, t) for t in ids) == text.encode()
    logprobs = [TokenLogprob(t, -0.1, [(t, -0.1), (0, -2.0)]) for t in ids]
    out = chat_logprobs_object(TokenPieces(qwen_tokenizer), logprobs, top_k=1)
    assert bytes(b for entry in out["content"] for b in entry["bytes"]) == text.encode()
    assert all(len(entry["top_logprobs"]) == 1 for entry in out["content"])


def models_chat_logprobs(tokenizer, logprobs: list[TokenLogprob], top_k: int) -> ChoiceLogprobs:
    """The pydantic construction that `chat_logprobs_object`'s dicts replace on the per-token path."""
    def entry(token_id: int, logprob: float) -> TopLogprob:
        raw = token_bytes(tokenizer, token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    return ChoiceLogprobs(content=[
        TokenLogprobOut(**entry(e.token_id, e.logprob).model_dump(),
                        top_logprobs=[entry(token_id, logprob) for token_id, logprob in e.top[:top_k]])
        for e in logprobs
    ])


@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_chat_logprobs_object_is_the_models_dump(qwen_tokenizer, top_k):
    # parts of characters, an added token, eos, an id past the tokenizer's vocabulary; an int logprob, -inf
    ids = [*qwen_tokenizer.encode("héllo 世界 🙂 <think> héllo", add_special_tokens=False),
           qwen_tokenizer.eos_token_id, 151935]
    logprobs = [TokenLogprob(t, -0.5 * i, [(t, -0.1), (ids[0], 0), (151935, float("-inf"))]) for i, t in enumerate(ids)]
    expected = orjson.dumps(models_chat_logprobs(qwen_tokenizer, logprobs, top_k).model_dump())
    pieces = TokenPieces(qwen_tokenizer)
    assert orjson.dumps(chat_logprobs_object(pieces, logprobs, top_k)) == expected
    assert orjson.dumps(chat_logprobs_object(pieces, logprobs, top_k)) == expected  # from the remembered pieces
    assert chat_logprobs_object(pieces, [], top_k) == ChoiceLogprobs(content=[]).model_dump()


def test_token_pieces_text_is_the_token_decoded_alone(qwen_tokenizer):
    pieces = TokenPieces(qwen_tokenizer)
    ids = [*qwen_tokenizer.encode("héllo 世界 🙂 <think>", add_special_tokens=False), qwen_tokenizer.eos_token_id]
    for _ in range(2):  # the second time from what it remembers
        assert [pieces.text(t) for t in ids] == [qwen_tokenizer.decode([t], skip_special_tokens=False) for t in ids]
