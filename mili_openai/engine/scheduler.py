"""Continuous batching: which sequences run in the next forward, and with how many tokens each.

Each step mixes one decode token per running sequence with prefill chunks (of running sequences that
are part-way through their prompt, then of newly admitted ones) under a token budget. When pages run
out, the newest running sequence is preempted: its pages are released (full ones stay cached in the
radix tree) and it goes back to the front of the queue to be recomputed.

A vision model's chunks also share a cap on the image patches the step encodes (engine/encoder_budget.py): a
chunk stops before an image the step has no encoder budget left for.

A model with linear-attention layers also needs a state slot per running sequence (`state_slots`,
engine/state_slots.py): a sequence is admitted only when both a slot and its pages are free, and gives its
slot back when it finishes or is preempted.

Scheduling a step commits it: the tokens it computes count as computed, and the tokens it samples as
pending until `Sequence.append_token`. So the next step can be planned while this one runs (`lookahead`):
a decode then feeds the token its sequence has pending, which the model runner takes from the step
before. A lookahead step never preempts (the victim may be in the running step): a sequence that finds
no page waits for the next step instead.

With speculative decoding on, a decode may also verify draft tokens (a `Proposer`, engine/proposers.py): it
computes its last token and the drafts, and its pending token becomes the sampled tokens that the drafts agree
with, plus one. The K/V of rejected drafts is rolled back in `EngineCore.postprocess` (and a linear layer's
state by the model runner, engine/speculation.py). Drafts need the last token's id, so a lookahead step never
has them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from mili_openai.config import SPECULATIVE_DEVICE_DEFAULT, EngineConfig
from mili_openai.engine.encoder_budget import EncoderBudget
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.proposers import DraftSwitch, make_proposer
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence, SequenceStatus
from mili_openai.engine.state_slots import StateSlotManager


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
    def __init__(self, config: EngineConfig, pages: KVPageManager, state_slots: StateSlotManager | None = None) -> None:
        speculative = config.speculative_config
        if (config.max_num_batched_tokens is None or config.max_num_seqs is None
                or (speculative is not None and speculative.disable_by_batch_size == SPECULATIVE_DEVICE_DEFAULT)):
            raise ValueError("the scheduler needs a config with the device's defaults (EngineConfig.for_device)")
        self.config = config
        self.pages = pages
        self.state_slots = state_slots  # None for a model without linear-attention layers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.proposer = make_proposer(speculative) if speculative is not None else None
        self.draft_switch = DraftSwitch(speculative) if speculative is not None else None
        self.max_drafting_batch = speculative.disable_by_batch_size if speculative is not None else None
        # positions a model proposer's chained drafts write past the verified ones (Proposer.draft_lookahead)
        self.draft_lookahead = self.proposer.draft_lookahead if self.proposer is not None else 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the engine (finished or aborted) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
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
        speculates = self._drafts_at(len(self.running))
        drafting = not lookahead and speculates
        encoder = EncoderBudget(self.config.max_encoder_patches_per_step)

        for seq in list(self.running):  # oldest first; preemption takes from the newest end
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._awaits_last_token(seq):
                continue  # preempted earlier in this loop, or done once its pending token is back
            uncomputed = seq.num_uncomputed_tokens
            num_new = encoder.limit(seq, self.pages.prefill_chunk(seq, min(uncomputed, budget)))
            if num_new == 0:
                continue  # its next image waits for a step with encoder budget
            if not self._reserve(seq, num_new, preempted, can_preempt=not lookahead):
                continue  # seq itself was preempted, or found no page
            budget -= num_new
            # a pooling input's last token stays a prefill chunk: the runner pools prefill rows only
            (decodes if uncomputed == 1 and not seq.pooled else prefills).append((seq, num_new))
        # drafts after every running sequence has its token and pages: a guess never takes those
        draft_tokens: list[list[int]] = []
        for seq, _ in decodes:
            draft_tokens.append(self._drafts(seq, budget) if drafting else [])
            budget -= len(draft_tokens[-1])
        decodes = [(seq, 1 + len(drafts)) for (seq, _), drafts in zip(decodes, draft_tokens)]

        new_state_slots: list[int] = []
        if not preempted:
            budget = self._admit(budget, prefills, new_state_slots, encoder)
        if prefills and self.waiting:
            self._ask_branch_saves(prefills)

        scheduled = decodes + prefills
        if not scheduled:
            return None
        batch = ScheduledBatch(
            seqs=[seq for seq, _ in scheduled],
            num_new_tokens=[n for _, n in scheduled],
            positions=[seq.num_computed_tokens for seq, _ in scheduled],
            num_decode=len(decodes),
            # a decode always samples (its drafts are computed, not pending); a chunk does at the prompt's end,
            # unless it is a pooling request's (it ends there: EngineCore.postprocess)
            samples=[True] * len(decodes) + [seq.num_uncomputed_tokens == n and not seq.pooled for seq, n in prefills],
            preempted=preempted,
            draft_tokens=draft_tokens,
            new_state_slots=new_state_slots,
            proposes_for=self._proposes_for(scheduled, speculates),
        )
        for seq, num_new, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += num_new
            seq.num_pending_tokens += samples
        if self.pages.snapshots is not None:  # a hybrid model's state saves and restores (state_snapshots.py)
            self.pages.snapshots.plan(batch)
        return batch

    def can_plan_ahead(self, running: ScheduledBatch) -> bool:
        """Whether the step after `running` may be planned before running's tokens are back.

        Not after prefill chunks (sequences admitted meanwhile could not see the prefix pages the chunks
        are computing, and would compute them again). With speculative decoding, not after a step with
        drafts (how many tokens it keeps is unknown until verified), nor after a step whose model proposer
        drafts for the next (MTP, a draft model), nor where a sequence still drafting has known tokens that
        end in an n-gram seen before: its text repeats itself, so its next step would likely draft, and a
        step planned ahead cannot (it does not know its last token). Elsewhere the overlap is worth more.
        """
        if running.num_decode != len(running.seqs) or any(running.draft_tokens):
            return False
        if not self._drafts_at(len(self.running)):
            return True
        if self.proposer.drafts_in_runner:  # the running step may be drafting for its sequences' next steps
            return not running.run_proposer
        return not any(self.draft_switch.allows(seq) and self.proposer.propose(seq, 1) for seq in running.seqs)

    def _proposes_for(self, scheduled: list[tuple[Sequence, int]], speculates: bool) -> list[bool]:
        """Per scheduled sequence, whether the runner's model proposer drafts its next step: not for one the
        DraftSwitch turned off, so that a request whose drafts are mostly rejected costs a plain step (no
        catch-up, no chained drafts, and the step after may be planned ahead). Also in a step planned ahead,
        where new prompts' chunks may run: a proposer's caches must cover every token of a sequence it drafts for."""
        if not speculates or not self.proposer.drafts_in_runner:
            return [False] * len(scheduled)
        return [self.draft_switch.allows(seq) for seq, _ in scheduled]

    def _drafts_at(self, batch_size: int) -> bool:
        """Whether a step with batch_size running sequences drafts (SpeculativeConfig.disable_by_batch_size)."""
        return self.proposer is not None and (self.max_drafting_batch is None or batch_size <= self.max_drafting_batch)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens seq verifies in this step: as many as the budget left (after every running
        sequence's own tokens and the drafts before), its max_tokens (the drafts and the token sampled
        after them) and the pages it holds or finds free allow. A guess never evicts a cached prefix nor
        preempts a sequence."""
        if seq.num_pending_tokens or not self.draft_switch.allows(seq):
            # its last token is still being sampled; its drafts were mostly rejected (DraftSwitch)
            return []
        room = seq.max_tokens - len(seq.output_token_ids) - 1
        drafts = self.proposer.propose(seq, min(budget, room))
        if seq.grammar is not None:  # a structured output's drafts stop at the first its format disallows
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        if drafts or self.draft_lookahead:
            free = self.pages.pool.num_free
            slots = (len(seq.pages) + free) * self.pages.page_size
            drafts = drafts[: slots - seq.num_computed_tokens - 1]
            wanted = self.pages.pages_needed(seq, 1 + len(drafts) + self.draft_lookahead)
            self.pages.allocate(seq, min(wanted, free))  # from free pages
        return drafts

    @staticmethod
    def _awaits_last_token(seq: Sequence) -> bool:
        """Its pending token will be its last (max_tokens): nothing more to compute for it."""
        return seq.num_pending_tokens > 0 and len(seq.output_token_ids) + seq.num_pending_tokens >= seq.max_tokens

    def _reserve(self, seq: Sequence, num_new: int, preempted: list[Sequence], can_preempt: bool) -> bool:
        """Allocate pages for seq's next tokens, preempting newer sequences (if allowed) until they fit."""
        needed = self.pages.pages_needed(seq, num_new)
        if needed == 0:  # most decode steps: the token fits in the last page
            return True
        while not self.pages.allocate(seq, needed):
            if not can_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _release(self, seq: Sequence) -> None:
        """Give back what a running sequence holds: its pages and its state slot."""
        self.pages.release(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _admit(self, budget: int, prefills: list[tuple[Sequence, int]], new_state_slots: list[int],
               encoder: EncoderBudget) -> int:
        """Move waiting sequences into running while budget, sequence cap, pages and state slots allow (FIFO);
        the slots handed out go to `new_state_slots`."""
        deferred: list[Sequence] = []
        adapters = self._running_adapters()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            if adapters is not None and seq.lora_id and seq.lora_id not in adapters:
                if len(adapters) >= self.config.lora.max_loras:  # its adapter would be one too many in a step
                    deferred.append(seq)
                    continue
                adapters.add(seq.lora_id)
            matched = self.pages.match(seq)
            if seq.first_scheduled_time is None:  # before its chunk is cut (StateSnapshots.prompt_stop reads it)
                seq.num_cached_tokens = matched
            wait, freed = self._shares_prefix_in_flight(seq, matched, prefills)
            budget += freed
            if wait:
                # A sequence already being prefilled is computing pages this one could reuse: wait one
                # step for them to land in the tree rather than compute the same prefix twice.
                self.pages.release(seq)
                deferred.append(seq)
                continue
            num_new = encoder.limit(seq, self.pages.prefill_chunk(seq, min(seq.num_uncomputed_tokens, budget)),
                                    admitted=True)
            no_slot = self.state_slots is not None and self.state_slots.num_free == 0
            if num_new == 0 or no_slot or not self.pages.allocate(seq, self.pages.pages_needed(seq, num_new)):
                self.pages.release(seq)
                self.waiting.appendleft(seq)
                break
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
                new_state_slots.append(seq.state_slot)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.prefix_cache_queries_total += seq.num_prompt_tokens
                self.prefix_cache_hits_total += matched
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _running_adapters(self) -> set[int] | None:
        """The LoRA adapters the running sequences use (every step runs them all): at most max_loras; None
        without LoRA."""
        if self.config.lora is None:
            return None
        return {seq.lora_id for seq in self.running if seq.lora_id}

    def _shares_prefix_in_flight(self, seq: Sequence, matched: int,
                                 prefills: list[tuple[Sequence, int]]) -> tuple[bool, int]:
        """Whether seq should wait a step for a prefix that a sequence being prefilled computes, and the budget
        tokens given back: a hybrid model's chunk that runs past the branch point stops there, to save its
        state where seq can resume (engine/state_snapshots.py)."""
        if not self.pages.enable_prefix_caching:
            return False, 0
        for index, (other, _) in enumerate(prefills):
            shared = self._shared_pages(seq, other)
            if shared <= matched:
                continue
            will_cache, freed = self._stop_chunk_at(prefills, index, shared)
            if will_cache:
                return True, freed
        return False, 0

    def _ask_branch_saves(self, prefills: list[tuple[Sequence, int]]) -> None:
        """A hybrid model's waiting prompts that admission did not reach this step (budget, sequence cap) may
        share a prefix with a chunk running now: that chunk saves its state at the branch point as it passes,
        or the state there is gone by the time they are admitted and they run cold."""
        if self.pages.snapshots is None or not self.pages.enable_prefix_caching:
            return
        page_size = self.pages.page_size
        for seq in itertools.islice(self.waiting, self.config.max_num_seqs):
            for index, (other, _) in enumerate(prefills):
                # most unrelated prompts differ in their first page: compare that before the whole prefix
                if seq.token_ids[:page_size] != other.token_ids[:page_size]:
                    continue
                shared = self._shared_pages(seq, other)
                if shared > other.num_computed_tokens:
                    self._stop_chunk_at(prefills, index, shared)

    def _shared_pages(self, seq: Sequence, other: Sequence) -> int:
        """The prefix of seq's prompt (whole pages, its last token excluded) that other's tokens hold, under the
        same adapter (other's pages hold its adapter's K/V) and with the same images (compared by their keys)."""
        if other.lora_id != seq.lora_id:
            return 0
        page_size = self.pages.page_size
        limit = min(seq.num_tokens - 1, other.num_tokens)
        if seq.images is None and other.images is None:
            mine, theirs = seq.token_ids[:limit], other.token_ids[:limit]
        else:
            mine, theirs = seq.cache_key(limit), other.cache_key(limit)
        return common_prefix_length(mine, theirs) // page_size * page_size

    def _stop_chunk_at(self, prefills: list[tuple[Sequence, int]], index: int, position: int) -> tuple[bool, int]:
        """Have prefills[index]'s sequence leave its first `position` tokens where another can resume from them
        (a hybrid model's chunk is cut there, to save its state); whether it will, and the budget tokens freed."""
        other, num_new = prefills[index]
        start, freed = other.num_computed_tokens, 0
        if self.pages.snapshots is not None and start < position < start + num_new:
            freed = start + num_new - position
            prefills[index] = (other, position - start)
        return self.pages.will_cache(other, position, start + num_new - freed), freed
