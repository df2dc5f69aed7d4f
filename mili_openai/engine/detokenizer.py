"""Incremental detokenisation: token ids in, text pieces out, never a broken UTF-8 character.

Byte-level BPE tokens are byte strings; one token can end halfway through a multi-byte character
(Chinese, emoji), and decoding it alone yields U+FFFD. Like vLLM and TGI we keep two offsets into the
token list and decode only a short window:

    ids[prefix_offset:read_offset]   already emitted; decoded again only as context
    ids[read_offset:]                not emitted yet

piece = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]. The context makes
tokens whose text depends on their neighbours (leading spaces, merged bytes) come out right; a piece
that ends in U+FFFD is held back until the character completes. The window starts inside the prompt
so that the first output token is decoded in context too.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output token (vLLM uses the same 5).
INITIAL_CONTEXT_TOKENS = 5
# A text ending in U+FFFD is held because the next token may complete the character. Bytes that are
# really invalid (an orphan continuation byte) look the same, so cap the wait to keep the decoded
# window short: past this many held tokens the text is emitted, U+FFFD and all. The cap is well above
# the 4 bytes of a UTF-8 character so that valid text is never split by it.
MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
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
        self._ids.extend(int(t) for t in token_ids)
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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
