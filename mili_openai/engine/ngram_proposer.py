"""Draft tokens for speculative decoding by prompt lookup (vLLM's "ngram" method).

Text that quotes its context (code edits, summaries, extraction, a model repeating itself) continues an
earlier stretch of the sequence. So the tokens that followed an earlier occurrence of the sequence's last
n tokens are a cheap guess at its next ones, and the model checks the whole guess in one forward: on a
memory-bound device that forward reads the weights once for all of its rows.

The match is vLLM's: the longest n in [min_n, max_n] whose n-gram occurs earlier, at its earliest
occurrence, and the (up to) k tokens after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mili_openai.config import SpeculativeConfig


def propose_ngram_draft(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram
    (min_n <= n <= max_n) of `token_ids`; [] when there is none."""
    total = len(token_ids)
    if k < 1 or total <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # starts whose n-gram is followed by at least one token (so not the suffix itself), narrowed one
        # column at a time: most starts fail on the first token, so this stays ~O(total)
        starts = np.flatnonzero(tokens[: total - n] == suffix[0])
        for offset in range(1, n):
            if not starts.size:
                break
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if starts.size:
            begin = int(starts[0]) + n
            return tokens[begin : begin + k].tolist()
    return []


class NgramProposer:
    """The drafts a decoding sequence verifies in its next step, capped by what it may still generate."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """max_drafts: how many the step can take (the token budget, and room under max_tokens for the
        drafts plus the token the step samples after them)."""
        k = min(self.num_speculative_tokens, max_drafts)
        return propose_ngram_draft(token_ids, self.min_n, self.max_n, k) if k > 0 else []
