"""Continuous batching: which sequences run in the next forward, and with how many tokens each.

Each step mixes one decode token per running sequence with prefill chunks (of running sequences that
are part-way through their prompt, then of newly admitted ones) under a token budget. When pages run
out, the newest running sequence is preempted: its pages are released (full ones stay cached in the
radix tree) and it goes back to the front of the queue to be recomputed.

Scheduling a step commits it: the tokens it computes count as computed, and the tokens it samples as
pending until `Sequence.append_token`. So the next step can be planned while this one runs (`lookahead`):
a decode then feeds the token its sequence has pending, which the model runner takes from the step
before. A lookahead step never preempts (the victim may be in the running step): a sequence that finds
no page waits for the next step instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mili_openai.config import EngineConfig
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (one new token each) first, then prefill chunks
    num_new_tokens: list[int]  # tokens computed for each sequence in this step
    positions: list[int]  # position of each sequence's first new token
    num_decode: int  # seqs[:num_decode] are decodes
    # whether each sequence gets a new token after this step (its chunk reaches its last token); fixed
    # at scheduling time, since an abort during the forward resets the sequence's counters
    samples: list[bool]
    preempted: list[Sequence] = field(default_factory=list)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Scheduler:
    def __init__(self, config: EngineConfig, pages: KVPageManager) -> None:
        self.config = config
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the engine (finished or aborted) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.pages.release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self, lookahead: bool = False) -> ScheduledBatch | None:
        """The next step, committed (see the module docstring); `lookahead`: planned while a step runs."""
        budget = self.config.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        for seq in list(self.running):  # oldest first; preemption takes from the newest end
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._awaits_last_token(seq):
                continue  # preempted earlier in this loop, or done once its pending token is back
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_new, preempted, can_preempt=not lookahead):
                continue  # seq itself was preempted, or found no page
            budget -= num_new
            (decodes if seq.num_uncomputed_tokens == 1 else prefills).append((seq, num_new))

        if not preempted:
            budget = self._admit(budget, prefills)

        scheduled = decodes + prefills
        if not scheduled:
            return None
        batch = ScheduledBatch(
            seqs=[seq for seq, _ in scheduled],
            num_new_tokens=[n for _, n in scheduled],
            positions=[seq.num_computed_tokens for seq, _ in scheduled],
            num_decode=len(decodes),
            samples=[seq.num_uncomputed_tokens == n for seq, n in scheduled],
            preempted=preempted,
        )
        for seq, num_new, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += num_new
            seq.num_pending_tokens += samples
        return batch

    @staticmethod
    def _awaits_last_token(seq: Sequence) -> bool:
        """Its pending token will be its last (max_tokens): nothing more to compute for it."""
        return seq.num_pending_tokens > 0 and len(seq.output_token_ids) + seq.num_pending_tokens >= seq.max_tokens

    def _reserve(self, seq: Sequence, num_new: int, preempted: list[Sequence], can_preempt: bool) -> bool:
        """Allocate pages for seq's next tokens, preempting newer sequences (if allowed) until they fit."""
        needed = self.pages.pages_needed(seq, num_new)
        while not self.pages.allocate(seq, needed):
            if not can_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _admit(self, budget: int, prefills: list[tuple[Sequence, int]]) -> int:
        """Move waiting sequences into running while budget, sequence cap and pages allow (FIFO)."""
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            matched = self.pages.match(seq)
            if self._shares_prefix_in_flight(seq, matched, prefills):
                # A sequence already being prefilled is computing pages this one could reuse: wait one
                # step for them to land in the tree rather than compute the same prefix twice.
                self.pages.release(seq)
                deferred.append(seq)
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.pages.allocate(seq, self.pages.pages_needed(seq, num_new)):
                self.pages.release(seq)
                self.waiting.appendleft(seq)
                break
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = matched
                self.prefix_cache_queries_total += seq.num_prompt_tokens
                self.prefix_cache_hits_total += matched
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _shares_prefix_in_flight(self, seq: Sequence, matched: int, prefills: list[tuple[Sequence, int]]) -> bool:
        if not self.pages.enable_prefix_caching:
            return False
        page_size = self.pages.page_size
        for other, _ in prefills:
            limit = min(seq.num_tokens - 1, other.num_tokens)
            shared = common_prefix_length(seq.token_ids[:limit], other.token_ids[:limit])
            if shared // page_size > matched // page_size:
                return True
        return False
