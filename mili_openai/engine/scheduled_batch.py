"""One step as the scheduler committed it: which sequences run, with how many new tokens each.

The scheduler builds it; the runner turns it into the model's inputs and the core postprocesses its
outputs, so it lives apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mili_openai.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (one new token each, plus any drafts) first, then prefill chunks
    num_new_tokens: list[int]  # tokens computed for each sequence in this step (a decode's drafts included)
    positions: list[int]  # position of each sequence's first new token
    num_decode: int  # seqs[:num_decode] are decodes
    # whether each sequence gets a new token after this step (its chunk reaches its last token); fixed
    # at scheduling time, since an abort during the forward resets the sequence's counters
    samples: list[bool]
    preempted: list[Sequence] = field(default_factory=list)
    # per decode (seqs[:num_decode]), the draft tokens it verifies after its last token ([] for none)
    draft_tokens: list[list[int]] = field(default_factory=list)
    # state slots handed out in this step (engine/state_slots.py): the runner zeroes them before the forward
    new_state_slots: list[int] = field(default_factory=list)
    # per sequence, whether the runner drafts with a model for its next step (engine/speculation.py); [] for none
    proposes_for: list[bool] = field(default_factory=list)
    # state-slot copies (source, destination) of a hybrid model's prefix cache (engine/state_snapshots.py): from a
    # snapshot into a running slot before the forward (after the zeroing), and from a running slot into a
    # snapshot after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # saves of decodes verifying drafts (decode index, row offset in its group, snapshot id): the state that row
    # left (kept for the rollback) is copied after sampling, where the row's token was accepted
    verified_saves: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def run_proposer(self) -> bool:
        """Whether the runner runs a model proposer after this step's sampling."""
        return any(self.proposes_for)

    def drafts(self, index: int) -> list[int]:
        """The draft tokens seqs[index] verifies: [] for a prefill chunk or a decode without drafts."""
        return self.draft_tokens[index] if index < self.num_decode else []
