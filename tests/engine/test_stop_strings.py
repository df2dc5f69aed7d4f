"""StopStringMatcher: holding back possible stop prefixes, releasing them, and cutting at a match."""

from __future__ import annotations

import random

import pytest

from mili_openai.engine.detokenizer import StopStringMatcher


def push_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    """Push pieces until a match; return (all emitted text, matched stop)."""
    emitted = []
    for piece in pieces:
        text, matched = matcher.push(piece)
        emitted.append(text)
        if matched is not None:
            return "".join(emitted), matched
    return "".join(emitted) + matcher.flush(), None


def test_no_stop_passes_text_through():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello world") == ("hello world", None)
    assert matcher.flush() == ""


def test_stop_split_across_many_pushes():
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.push("answer <") == ("answer ", None)
    assert matcher.push("|e") == ("", None)
    assert matcher.push("nd") == ("", None)
    assert matcher.push("|> tail") == ("", "<|end|>")


def test_stop_at_the_very_start():
    assert StopStringMatcher(["Hi"]).push("Hi there") == ("", "Hi")
    matcher = StopStringMatcher(["Hi"])
    assert matcher.push("H") == ("", None)
    assert matcher.push("i") == ("", "Hi")


def test_held_prefix_that_is_not_a_stop_is_released():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xab") == ("x", None)
    assert matcher.push("d") == ("abd", None)
    assert matcher.push("ab") == ("", None)
    assert matcher.flush() == "ab"
    assert matcher.flush() == ""


def test_release_keeps_a_later_prefix_held():
    matcher = StopStringMatcher(["aab"])
    assert matcher.push("aa") == ("", None)
    assert matcher.push("a") == ("a", None)  # "aaa": the tail "aa" may still become "aab"
    assert matcher.push("b") == ("", "aab")


def test_overlapping_stops():
    # "abcd" and "bc" overlap: "bc" completes first, so it wins and only "a" is emitted.
    assert StopStringMatcher(["abcd", "bc"]).push("xabcd") == ("xa", "bc")
    # Stops completing at the same character: the longest wins, so no part of a stop is emitted.
    assert StopStringMatcher(["c", "abc"]).push("xabc") == ("x", "abc")


def test_multiple_stops_earliest_wins():
    matcher = StopStringMatcher(["END", "STOP", "\n\n"])
    assert matcher.push("one STOP two END") == ("one ", "STOP")
    assert StopStringMatcher(["END", "STOP"]).push("a END b STOP") == ("a ", "END")


def test_unicode_stops():
    matcher = StopStringMatcher(["。", "🛑", "停止"])
    assert matcher.push("你好停") == ("你好", None)
    assert matcher.push("下来") == ("停下来", None)
    assert matcher.push("再见🛑后") == ("再见", "🛑")


def test_result_does_not_depend_on_how_text_is_split():
    rng = random.Random(0)
    stops = ["ab", "bca", "cc", "abcab"]
    for _ in range(300):
        text = "".join(rng.choice("abcx") for _ in range(rng.randrange(1, 20)))
        whole = push_all(StopStringMatcher(stops), [text])
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=rng.randrange(0, len(text))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert push_all(StopStringMatcher(stops), pieces) == whole
        one_char = push_all(StopStringMatcher(stops), list(text))
        assert one_char == whole
        emitted, matched = whole
        if matched is None:
            assert emitted == text
        else:
            assert text.startswith(emitted + matched)
            assert not any(stop in emitted + matched[:-1] for stop in stops)


def test_push_after_match_is_an_error():
    matcher = StopStringMatcher(["x"])
    assert matcher.push("x") == ("", "x")
    assert matcher.flush() == ""
    with pytest.raises(RuntimeError):
        matcher.push("more")


@pytest.mark.parametrize("stop", [[""], "abc"])
def test_invalid_stops_are_rejected(stop):
    with pytest.raises(ValueError):
        StopStringMatcher(stop)
