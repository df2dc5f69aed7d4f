"""Speculative decoding's proposers: where a decoding sequence's draft tokens come from (one framework, the
scheduler asks a `Proposer`, the model verifies every draft in the decode's one forward).

- `NgramProposer` (vLLM's "ngram", prompt lookup): text that quotes its context (code edits, summaries,
  extraction, a model repeating itself) continues an earlier stretch of the sequence, so the tokens that
  followed an earlier occurrence of the sequence's last n tokens are a cheap guess at its next ones. The match
  is vLLM's: the longest n in [min_n, max_n] whose n-gram occurs earlier, at its earliest occurrence, and the
  (up to) k tokens after it.
- `ModelProposer` ("mtp", "draft_model"): the drafts a model made at the end of the sequence's previous step (the
  checkpoint's MTP module, engine/mtp_drafter.py, or a smaller checkpoint, engine/draft_model.py, run by the
  model runner right after sampling), kept on the sequence.

Every proposer's drafts are one token per position for sure (a greedy guess, not a sample), so verifying them
by the target's own samples is Leviathan et al.'s rejection sampling with a point-mass draft distribution: the
draft is kept with the target's probability of it, else the target's sample (a draw from the target without
the draft) stands. The tokens keep plain decoding's distribution; greedy rows keep its very tokens.

`DraftSwitch` is the adaptive off-switch: a sequence whose drafts are mostly rejected pauses its drafting, since a
rejected draft costs a row of the forward (and a model proposer's run) and earns nothing, and probes again later.
"""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence
from typing import Protocol

import numpy as np

from mili_openai.config import DRAFT_MODEL_SPECULATIVE_METHOD, MTP_SPECULATIVE_METHOD, SpeculativeConfig
from mili_openai.engine.sequence import Sequence


def propose_ngram_draft(token_ids: TokenSequence[int], min_n: int, max_n: int, k: int) -> list[int]:
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


class Proposer(Protocol):
    """Draft tokens for a decoding sequence's next step."""

    # whether the drafts come from a model run in the step before (the runner then drafts for every sampled
    # sequence, and a step cannot be planned before the one running returns them)
    drafts_in_runner: bool
    # positions past a decode's verified ones whose K/V that model writes while drafting (pages the scheduler
    # allocates ahead): its chained drafts' rows
    draft_lookahead: int

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """At most max_drafts tokens (the token budget, and room under max_tokens for the drafts plus the token
        the step samples after them); [] for none."""


class NgramProposer:
    drafts_in_runner = False
    draft_lookahead = 0

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_drafts)
        return propose_ngram_draft(seq.token_ids, self.min_n, self.max_n, k) if k > 0 else []


class ModelProposer:
    drafts_in_runner = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        # the MTP module reads the token after each row, so its chain ends a row before a draft model's, which
        # runs the sampled token and then each draft but the last (engine/mtp_drafter.py, engine/draft_model.py)
        extra_row = config.method == DRAFT_MODEL_SPECULATIVE_METHOD
        self.draft_lookahead = config.num_speculative_tokens - 1 + extra_row

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_drafts)
        return seq.proposed_drafts[:k] if k > 0 else []


class DraftSwitch:
    """The adaptive off-switch, per sequence (TensorRT-LLM's acceptance gate, with onnxruntime-genai's cool-down).

    A sequence drafts until its window holds `min_drafts_for_switch` verified drafts; from then on, while the
    window's acceptance rate stays at least `min_acceptance_rate`, it keeps drafting (the window halves its counts
    each time it holds WINDOW_FILLS times that many, so recent drafts weigh most). Below the rate it pauses for
    `switch_backoff_tokens` output tokens, in which it costs a plain step: no drafts to verify, and a model proposer
    does not run for it. Then it probes: its next verify step alone decides, drafting resuming (the pause back
    to its first length) where the step keeps its share of drafts, else pausing twice as long as before (at most
    MAX_PAUSE_FACTOR times the first). A backoff of 0 keeps a switched-off sequence off.

    A random head's request is decided on its first `min_drafts_for_switch` drafts (by default two verify
    steps); a head that kept a share before a bad stretch gets its drafting back after one good probe.
    """

    WINDOW_FILLS = 4
    MAX_PAUSE_FACTOR = 16

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_rate = config.min_acceptance_rate
        self.min_drafts = config.min_drafts_for_switch
        self.first_pause = config.switch_backoff_tokens

    def allows(self, seq: Sequence) -> bool:
        """Whether seq drafts now (or, with a model proposer, has its next step's drafts made)."""
        resume_at = seq.draft_window.resume_at
        return self.min_rate <= 0 or resume_at is None or len(seq.output_token_ids) >= resume_at

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """seq verified `num_drafts` drafts in a step and kept `num_accepted`, the step's tokens not appended yet
        (EngineCore._verify_drafts): move its window on, pausing it or taking it out of its pause."""
        if self.min_rate <= 0 or num_drafts == 0:
            return
        window = seq.draft_window
        keeps_share = num_accepted >= self.min_rate * num_drafts
        if window.resume_at is not None:  # a probe, after a pause: this step alone decides
            if keeps_share:
                window.drafts, window.accepted, window.resume_at, window.pause = num_drafts, num_accepted, None, 0
            else:
                self._pause(seq, num_accepted)
            return
        window.drafts += num_drafts
        window.accepted += num_accepted
        if window.drafts < self.min_drafts:
            return
        if window.accepted < self.min_rate * window.drafts:
            self._pause(seq, num_accepted)
        elif window.drafts >= self.WINDOW_FILLS * self.min_drafts:
            window.drafts, window.accepted = window.drafts // 2, window.accepted // 2

    def _pause(self, seq: Sequence, num_accepted: int) -> None:
        """Pause seq's drafting for its next pause's length, counted after the tokens of the step that decided it
        (its kept drafts and its sample)."""
        window = seq.draft_window
        if self.first_pause == 0:  # no probes: off for good
            window.resume_at = seq.max_tokens + 1
            return
        pause = self.first_pause if window.pause == 0 else window.pause
        window.resume_at = len(seq.output_token_ids) + num_accepted + 1 + pause
        window.pause = min(2 * pause, self.MAX_PAUSE_FACTOR * self.first_pause)
        window.drafts = window.accepted = 0


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method`."""
    if config.method in (MTP_SPECULATIVE_METHOD, DRAFT_MODEL_SPECULATIVE_METHOD):
        return ModelProposer(config)
    return NgramProposer(config)
