"""Generated tokens to text safe to show: never a broken UTF-8 character, never part of a stop string.

Incremental detokenisation: token ids in, text pieces out.

Byte-level BPE tokens are byte strings; one token can end halfway through a multi-byte character
(Chinese, emoji), and decoding it alone yields U+FFFD. Like vLLM and TGI we keep two offsets into the
token list and decode only a short window:

    ids[prefix_offset:read_offset]   already emitted; decoded again only as context
    ids[read_offset:]                not emitted yet

piece = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]. The context makes
tokens whose text depends on their neighbours (leading spaces, merged bytes) come out right; a piece
that ends in U+FFFD is held back until the character completes. The window starts inside the prompt
so that the first output token is decoded in context too.

Stop strings (`StopStringMatcher`) over the streamed text: emit what is safe, hold back what could
still become a stop string.

The matcher keeps a small buffer: the longest tail of the text seen so far that is a prefix of some
stop string. Nothing before that tail can be part of a stop, so it is emitted at once; the tail waits
until the next piece either completes a stop (the sequence finishes, the stop is never emitted) or
rules it out (the tail is released).

When several stops occur, the one that *completes* first wins, so the result does not depend on how
the text was split into pieces; among stops completing at the same character the longest wins, so no
part of a stop string ever reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output token (vLLM uses the same 5).
INITIAL_CONTEXT_TOKENS = 5
# A text ending in U+FFFD is held because the next token may complete the character. Bytes that are
# really invalid (an orphan continuation byte) look the same, so cap the wait to keep the decoded
# window short: past this many held tokens the text is emitted, U+FFFD and all. The cap is well above
# the 4 bytes of a UTF-8 character so that valid text is never split by it.
MAX_HELD_TOKENS = 16


def fast_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, as `tokenizer.decode` gives it. A fast tokenizer with no space clean-up decodes through
    its Rust backend directly: the same text, without transformers' per-call argument conversions, which
    cost several times the decode itself (two decodes per token of every running sequence)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class TokenDecoder:
    """ids -> text as `fast_decoder` gives it, keeping each single token's text. Once a stream is under way
    the detokeniser's context window is the one token it emitted last, so one of its two decodes per token
    is of one token: shared by every sequence of an engine, that becomes a dictionary lookup (at most one
    entry per vocabulary token). Not thread-safe: one per thread that detokenises."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self._decode = fast_decoder(tokenizer, skip_special_tokens)
        self._single_token_texts: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> str:
        if len(ids) != 1:
            return self._decode(ids)
        text = self._single_token_texts.get(ids[0])
        if text is None:
            text = self._single_token_texts[ids[0]] = self._decode(ids)
        return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 decoder: TokenDecoder | None = None) -> None:
        """decoder: a `TokenDecoder` of `tokenizer` at `skip_special_tokens`, to share with other sequences."""
        self._decode = decoder if decoder is not None else TokenDecoder(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._num_context = len(context)
        self._ids = context  # context tokens followed by the output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []  # emitted pieces, joined lazily by `text`

    @property
    def token_ids(self) -> list[int]:
        """Output token ids so far."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until they complete or `flush`)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the new text they complete (possibly "")."""
        self._ids.extend(map(int, token_ids))
        piece = self._new_text(force=False)
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """On finish: emit whatever is held back, U+FFFD included if the bytes never completed."""
        piece = self._new_text(force=True)
        if piece:
            self._pieces.append(piece)
        return piece

    def _new_text(self, force: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        held_tokens = len(self._ids) - self._read_offset
        incomplete = full_text.endswith(REPLACEMENT_CHAR) and held_tokens <= MAX_HELD_TOKENS
        # Shorter or equal text means the new tokens decoded to nothing visible yet (a skipped special
        # token, or bytes that merge with the context): keep the window and wait.
        if not force and (incomplete or len(full_text) <= len(prefix_text)):
            return ""
        # Slide the window: what was just read becomes the context of the next token.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not a single string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = tuple(dict.fromkeys(stop))  # deduplicated, in the caller's order
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def push(self, new_text: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string matched or None).

        After a match the caller finishes the sequence; pushing again is a programming error.
        """
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched; the sequence is finished")
        buffer = self._held + new_text
        match = self._first_completed_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched = stop
            return buffer[:start], stop
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """On finish without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_completed_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop): earliest end, then longest
        for stop in self.stop:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), -len(stop), stop)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, negative_length, stop = best
        return end + negative_length, stop

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._max_held), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
