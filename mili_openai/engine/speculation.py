"""What a step verifying drafts, or drafting for the next step, asks of the model runner (the runner's side of
speculative decoding; the scheduler's is engine/proposers.py).

On the loop thread, with the step's inputs, `plan_speculation` notes each decode's drafts and, where a model
proposes (MTP), what it reads: the token after each prefill row and each sequence's pages. On the forward
thread, right after sampling, `StepSpeculation.after_sampling`:
1. counts the drafts each decode's samples agree with (the rule `EngineCore.postprocess` applies too);
2. rolls linear-attention states back: the decode's rows ran one after another over its state slot, keeping
   the state each row left (model/gated_deltanet.py, model/state_cache.py); a decode that kept j of its k
   drafts gets the state its row j left, which is its state after its last kept token; and where the prefix
   cache saves a state at a page boundary its rows crossed, the row reaching it, if kept, is copied into the
   snapshot (engine/state_snapshots.py);
3. runs the model proposer over the step's kept rows (engine/mtp_drafter.py) for the next step's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.state_cache import StateCache

NO_TOKEN = -1  # a prefill row whose next token is the one its chunk samples


@dataclass(slots=True)
class SpeculationPlan:
    group_rows: list[int]  # per decode: its first row (a decode has 1 + len(drafts) rows)
    group_drafts: list[list[int]]  # per decode: the drafts it verifies
    group_slots: list[int] | None  # per decode: its state slot; None without linear-attention layers
    # for a model proposer (None where none runs this step): per prefill row, the token after it (NO_TOKEN:
    # the one its chunk samples), the batch index of each sampled sequence in logits order, each sequence's pages
    next_ids: np.ndarray | None = None
    sampled_seqs: list[int] | None = None
    # per sequence, whether the proposer drafts for it (ScheduledBatch.proposes_for: not once the DraftSwitch
    # turned it off); its catch-up rows and chained drafts are left out where not
    proposes_for: list[bool] | None = None
    pages: list[np.ndarray] | None = None
    # a hybrid prefix cache's saves in decodes verifying drafts (ScheduledBatch.verified_saves): (decode, its row,
    # snapshot id), copied from that row's kept state where the row's token is accepted
    snapshot_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # and its other saves of the step (ScheduledBatch.state_saves: (state slot, snapshot id), copied after the
    # forward), which a draft model with linear-attention layers makes of its own states after its catch-up
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # per sequence: the position of the token it samples where none of its drafts is kept, and its state slot
    # (None without linear-attention layers)
    sample_positions: list[int] | None = None
    state_slots: list[int] | None = None
    # per sequence, its structured output's matcher (None: none), which masks a model's drafts as the target's
    # tokens; None where no sequence of the step has a format
    grammars: list | None = None


def plan_speculation(batch: ScheduledBatch) -> SpeculationPlan | None:
    """The step's plan; None where it neither verifies drafts nor runs a model proposer."""
    if not batch.run_proposer and not any(batch.draft_tokens):
        return None
    num_decode = batch.num_decode
    starts = np.cumsum([0, *batch.num_new_tokens[:num_decode]])[:-1].tolist()
    decodes = batch.seqs[:num_decode]
    slots = [seq.state_slot for seq in decodes] if decodes and decodes[0].state_slot is not None else None
    plan = SpeculationPlan(starts, [batch.drafts(index) for index in range(num_decode)], slots,
                           snapshot_saves=list(batch.verified_saves), state_saves=list(batch.state_saves))
    if batch.run_proposer:
        next_ids = []
        for index in range(num_decode, len(batch.seqs)):
            seq, start, count = batch.seqs[index], batch.positions[index], batch.num_new_tokens[index]
            following = seq.token_ids[start + 1 : start + count + 1]
            next_ids.extend(following + [NO_TOKEN] * (count - len(following)))
        plan.next_ids = np.asarray(next_ids, dtype=np.int64)
        plan.sampled_seqs = [index for index, samples in enumerate(batch.samples) if samples]
        plan.proposes_for = batch.proposes_for
        plan.pages = [np.asarray(seq.pages, dtype=np.int64) for seq in batch.seqs]
        # a decode samples after its first row, a chunk after its last
        plan.sample_positions = [start + (1 if index < num_decode else count) for index, (start, count)
                                 in enumerate(zip(batch.positions, batch.num_new_tokens))]
        if batch.seqs[0].state_slot is not None:
            plan.state_slots = [seq.state_slot for seq in batch.seqs]
        if any(seq.grammar is not None for seq in batch.seqs):
            plan.grammars = [seq.grammar for seq in batch.seqs]
    return plan


def accepted_counts(plan: SpeculationPlan, tokens: list[int]) -> list[int]:
    """Per decode, how many leading drafts its rows' samples (`tokens`, decode rows first) agree with."""
    counts = []
    for first, drafts in zip(plan.group_rows, plan.group_drafts):
        accepted = 0
        while accepted < len(drafts) and tokens[first + accepted] == drafts[accepted]:
            accepted += 1
        counts.append(accepted)
    return counts


class Drafter(Protocol):
    """A model proposer run by the runner after sampling (engine/mtp_drafter.py, engine/draft_model.py)."""

    def reset_states(self, slots: torch.Tensor) -> None:
        """Zero the state slots handed out in this step, where the proposer keeps states of its own."""

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy state slots `src` into `dst` (pairwise), where the proposer keeps states of its own: a sequence
        resuming from a prefix's state snapshot (engine/state_snapshots.py) resumes the proposer's too."""

    def propose(self, plan: SpeculationPlan, batch: ForwardBatch, hidden: torch.Tensor, tokens: list[int],
                accepted: list[int]) -> list[list[int]]:
        """The next step's drafts of every sequence of the batch (in batch order; [] for none). `tokens`: the
        step's samples in logits order ([] where nothing sampled: the proposer still reads the chunks)."""


class StepSpeculation:
    """The runner's part of speculative decoding, around one step's forward and sampling."""

    def __init__(self, state_cache: StateCache | None, drafter: Drafter | None) -> None:
        self.state_cache = state_cache
        self.drafter = drafter

    def before_forward(self, batch: ForwardBatch, new_state_slots: torch.Tensor | None,
                       state_restores: torch.Tensor | None = None) -> None:
        """Where decodes verify drafts over linear layers, keep the state each decode row leaves; the proposer's
        states of the slots handed out in this step start from zeros, or from the snapshots `state_restores`
        ((2, N): snapshot ids, slots), as the target's."""
        if self.drafter is not None:
            if new_state_slots is not None:
                self.drafter.reset_states(new_state_slots)
            if state_restores is not None:
                self.drafter.copy_states(*state_restores)
        if self.state_cache is not None:
            self.state_cache.keep_verified_states(batch.num_decode if batch.decode_groups is not None else None)

    def after_sampling(self, plan: SpeculationPlan | None, batch: ForwardBatch, hidden: torch.Tensor,
                       token_ids: torch.Tensor | None) -> list[list[int]] | None:
        """Roll rejected drafts' states back and draft for the next step -> its drafts per sequence, or None.
        token_ids None: the step sampled nothing (prefill chunks only), which a model proposer reads too."""
        rolls_back = self.state_cache is not None and batch.decode_groups is not None
        if plan is None or not (rolls_back or (self.drafter is not None and plan.next_ids is not None)):
            return None  # nothing to do here: no host sync
        tokens = token_ids.tolist() if token_ids is not None else []
        accepted = accepted_counts(plan, tokens)
        if rolls_back:
            rolled = [(first + kept, slot) for first, kept, drafts, slot
                      in zip(plan.group_rows, accepted, plan.group_drafts, plan.group_slots) if kept < len(drafts)]
            # and the kept states of accepted rows that reach a page boundary into their snapshots
            rolled += [(plan.group_rows[decode] + row, snapshot_id) for decode, row, snapshot_id in plan.snapshot_saves
                       if row <= accepted[decode]]
            if rolled:
                rows, slots = zip(*rolled)
                self.state_cache.restore_kept(torch.tensor(rows), torch.tensor(slots))
            self.state_cache.keep_verified_states(None)
        if self.drafter is None or plan.next_ids is None:
            return None
        return self.drafter.propose(plan, batch, hidden, tokens, accepted)
