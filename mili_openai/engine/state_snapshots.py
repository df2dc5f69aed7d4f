"""Prefix caching for hybrid models: where sequences save their state, and handing the saves to the radix tree.

A model with linear-attention layers resumes a cached prefix only from a state snapshot at its end (the
radix side: radix/snapshots.py; the data: slots of the state pool past the running sequences', so a save or a
restore is one slot-to-slot copy in the step, `ScheduledBatch.state_saves` / `state_restores`). Snapshots are
taken with no extra forward pass, in the step that computes the position:

- the end of each prompt's prefill, rounded down to a page boundary: the last page boundary before the
  prompt's last token (what a repeat of the prompt and the next turn of a chat match). The prefill chunk that
  would run past it stops there, and the few tokens after it run in the next step: the prompt's first token
  comes a step later. So a prompt that resumed from a cached prefix saves there only when that spares a later
  prompt at least `min_prompt_save` tokens (the engine's: a quarter of a step's token budget) past it: a chat
  turn's new message is cheaper to compute again than to wait a step for (its reply's snapshot serves the next
  turn). A cold prompt always saves (a repeat of it would have nowhere else to resume);
- a point where another prompt branches off this one's path (`request_stop`, asked by a prompt that waits
  for this one's pages: a shared system prompt or few-shot block), or where this prompt leaves a cached path
  that has no snapshot (the same prompt sent again after the first has finished), and every `interval` pages
  if set;
- while decoding, each time a sequence's computed tokens reach a page boundary its state is copied into a
  snapshot it holds (one per sequence, overwritten at the next boundary); when the sequence ends (finished,
  aborted or preempted) that snapshot joins the tree at its boundary: it serves the chat's next turn, and a
  preempted sequence resumes from it;
- a decode verifying draft tokens (speculative decoding) runs several rows, and how many it keeps is known only
  after sampling: where its rows cross a page boundary, the state the row reaching it left (each row's is kept
  for the rollback, engine/speculation.py) is copied into a fresh snapshot after sampling, if that row's token
  was accepted (`plan_verified`, `settle_verified`); otherwise the snapshot goes back and the one it held stays.

A save planned in one step is attached to its node once that step's pages are in the tree; steps run in the
order they are scheduled, so a restore (always planned later) reads a finished save, and an id freed and
reserved again is written only after every earlier step's restore has read it.
"""

from __future__ import annotations

from collections.abc import Iterable

from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.radix import RadixCache, SnapshotStore


class StateSnapshots:
    def __init__(self, store: SnapshotStore, tree: RadixCache, page_size: int, interval_pages: int | None,
                 min_prompt_save: int = 0) -> None:
        """min_prompt_save: the fewest tokens past a prompt's resume point that its end's save must spare."""
        self.store = store
        self.tree = tree
        self.page_size = page_size
        self.interval = interval_pages * page_size if interval_pages else None  # in tokens
        self.min_prompt_save = min_prompt_save

    def prompt_stop(self, seq: Sequence) -> int:
        """The last page boundary before seq's last known token, where its prefill saves its state; 0 (no save)
        when the prompt fits in one page, or when it lies fewer than `min_prompt_save` tokens past the cached prefix
        seq resumed from (`Sequence.num_cached_tokens`; a cold prompt always saves)."""
        stop = (seq.num_tokens - 1) // self.page_size * self.page_size
        near = seq.num_cached_tokens and stop - seq.num_cached_tokens < self.min_prompt_save
        return 0 if near else stop

    def is_stop(self, seq: Sequence, position: int) -> bool:
        """Whether a prefill chunk ending at `position` saves the state there."""
        if position <= 0 or position % self.page_size:
            return False
        if position == self.prompt_stop(seq) or position in seq.snapshot_stops:
            return True
        return self.interval is not None and position % self.interval == 0

    def chunk_size(self, seq: Sequence, num_new: int) -> int:
        """num_new, or fewer so that the prefill chunk ends at the first stop inside it."""
        start = seq.num_computed_tokens
        stops = [self.prompt_stop(seq), *seq.snapshot_stops]
        if self.interval is not None:
            stops.append((start // self.interval + 1) * self.interval)
        inside = [stop for stop in stops if start < stop < start + num_new and stop % self.page_size == 0]
        return min(inside) - start if inside else num_new

    def request_stop(self, seq: Sequence, position: int, chunk_end: int) -> bool:
        """Ask seq (being prefilled up to `chunk_end` in this step) to save its state at `position`, a page
        boundary where another prompt branches off; False when seq has already computed past it."""
        if position < chunk_end or position <= 0:
            return False
        if position not in seq.snapshot_stops:
            seq.snapshot_stops.append(position)
        return True

    def plan(self, batch: ScheduledBatch) -> None:
        """After the batch is committed: its saves (running slot -> snapshot id) and the restores of the
        sequences it admits from a snapshot (snapshot id -> running slot)."""
        for index, seq in enumerate(batch.seqs):
            if seq.restore_snapshot is not None:
                batch.state_restores.append((seq.restore_snapshot, seq.state_slot))
                seq.restore_snapshot = None
            end = seq.num_computed_tokens
            decode = index < batch.num_decode
            if batch.drafts(index):  # its slot ends past the rows it may not keep
                self.plan_verified(batch, index)
                continue
            if end % self.page_size or end == 0 or not (decode or self.is_stop(seq, end)):
                continue
            snapshot_id = seq.snapshot[0] if seq.snapshot is not None else self.store.reserve()
            if snapshot_id is not None:
                seq.snapshot = (snapshot_id, end)
                batch.state_saves.append((seq.state_slot, snapshot_id))

    def plan_verified(self, batch: ScheduledBatch, index: int) -> None:
        """A decode verifying drafts: its rows feed positions start .. start + drafts; the first page boundary they
        reach (the only one unless there are as many drafts as a page has tokens) is saved from the row reaching
        it, into a fresh id (the one seq holds stays whole until the row is known kept: the step may be aborted)."""
        seq, start = batch.seqs[index], batch.positions[index]
        boundary = (start // self.page_size + 1) * self.page_size
        if boundary > seq.num_computed_tokens:
            return
        snapshot_id = self.store.reserve()
        if snapshot_id is not None:
            row = boundary - start - 1  # the row whose state covers the tokens before `boundary`
            seq.verified_snapshot = (snapshot_id, boundary, row)
            batch.verified_saves.append((index, row, snapshot_id))

    def settle_verified(self, seq: Sequence, num_accepted: int) -> None:
        """seq's drafts were verified, `num_accepted` kept: its planned save holds its state if the row reaching the
        boundary was kept (row 0, the decode's own token, always is), and replaces the snapshot seq held."""
        if seq.verified_snapshot is None:
            return
        snapshot_id, position, row = seq.verified_snapshot
        seq.verified_snapshot = None
        if row > num_accepted:
            self.store.release(snapshot_id)
            return
        if seq.snapshot is not None:
            self.store.release(seq.snapshot[0])
        seq.snapshot = (snapshot_id, position)

    def stats(self, slot_bytes: int) -> dict[str, int]:
        """EngineStats' fields of the snapshots; `slot_bytes`: one state slot's memory."""
        store = self.store
        return dict(num_state_snapshots=store.num_snapshots, num_state_snapshots_attached=store.num_attached,
                    state_snapshot_bytes=store.num_snapshots * slot_bytes,
                    state_snapshots_evicted_total=store.num_evicted_alone)

    def attach(self, seq: Sequence) -> None:
        """Hand seq's saved snapshot to the tree, once the pages up to it are there (`Sequence.num_tree_pages`)."""
        if seq.snapshot is None:
            return
        snapshot_id, position = seq.snapshot
        if position > seq.num_tree_pages * self.page_size:
            return  # its pages join the tree later: after its chunk, or when seq ends
        node = self.tree.insert(seq.cache_key(position), seq.pages[: position // self.page_size]).node
        self.store.attach(node, snapshot_id)
        seq.snapshot = None

    def release(self, seq: Sequence) -> None:
        """seq ends or is preempted, its pages already handed to the tree: attach its snapshot if it can be,
        else free it; forget what it asked for."""
        self.attach(seq)
        if seq.snapshot is not None:
            self.store.release(seq.snapshot[0])
            seq.snapshot = None
        if seq.verified_snapshot is not None:  # aborted in a verify step: its save never settled
            self.store.release(seq.verified_snapshot[0])
            seq.verified_snapshot = None
        seq.restore_snapshot = None
        seq.snapshot_stops.clear()

    @staticmethod
    def held(sequences: Iterable[Sequence]) -> list[int]:
        """The snapshot ids sequences hold (saved, not attached yet), for the integrity check."""
        sequences = list(sequences)
        held = [seq.snapshot[0] for seq in sequences if seq.snapshot is not None]
        return held + [seq.verified_snapshot[0] for seq in sequences if seq.verified_snapshot is not None]
