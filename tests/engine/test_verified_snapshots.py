"""The prefix cache's state saves in steps that verify draft tokens (engine/state_snapshots.py, engine/speculation.py):
the save is planned from the row that reaches the page boundary, into a fresh snapshot id; after sampling the runner
copies that row's kept state only where the row's token was accepted, and the engine keeps the fresh id then (the
snapshot the sequence held goes back) or gives it back otherwise. Unit-level, so both outcomes run every time (on
the tiny random models drafts are almost never kept)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.speculation import SpeculationPlan, StepSpeculation
from mili_openai.engine.state_snapshots import StateSnapshots
from mili_openai.model.cache_spec import RecurrentStateSpec
from mili_openai.model.state_cache import StateCache
from mili_openai.radix import PagePool, RadixCache, SnapshotStore

PAGE = 4
FIRST_SNAPSHOT = 2  # snapshot ids follow the running sequences' two state slots
DRAFTS = [7, 8]  # each decode verifies two drafts: rows = its own token, then the drafts


def verifying_decode(start: int) -> SimpleNamespace:
    """What StateSnapshots reads of a sequence whose decode feeds position `start` and two drafts."""
    return SimpleNamespace(num_computed_tokens=start + 1 + len(DRAFTS), snapshot=None, verified_snapshot=None,
                           restore_snapshot=None, state_slot=0, snapshot_stops=[])


def test_a_verify_step_saves_into_a_fresh_id_kept_only_where_the_row_is_accepted():
    store = SnapshotStore(4, FIRST_SNAPSHOT)
    snapshots = StateSnapshots(store, RadixCache(PAGE, PagePool(8), store), PAGE, None)
    kept, rejected, far = verifying_decode(6), verifying_decode(5), verifying_decode(8)
    held = store.reserve()
    kept.snapshot = (held, 4)  # the boundary its earlier decode saved
    batch = ScheduledBatch(seqs=[kept, rejected, far], num_new_tokens=[3, 3, 3], positions=[6, 5, 8], num_decode=3,
                           samples=[True] * 3, draft_tokens=[DRAFTS] * 3)
    snapshots.plan(batch)
    # rows feed positions start, start + 1, start + 2: boundary 8 is reached by row 1 (start 6) or row 2 (start 5);
    # a decode from 8 reaches no boundary (12 is past its rows), and no save runs from a slot's end state
    assert [(index, row) for index, row, _ in batch.verified_saves] == [(0, 1), (1, 2)]
    assert batch.state_saves == [] and far.verified_snapshot is None
    assert StateSnapshots.held([kept, rejected, far]) == [held, kept.verified_snapshot[0], rejected.verified_snapshot[0]]
    fresh = kept.verified_snapshot[0]
    snapshots.settle_verified(kept, num_accepted=1)  # row 1 (its first draft) kept
    snapshots.settle_verified(rejected, num_accepted=1)  # row 2 (its second draft) rejected
    assert kept.snapshot == (fresh, 8) and kept.verified_snapshot is None
    assert rejected.snapshot is None and rejected.verified_snapshot is None
    assert store.num_free == store.num_snapshots - 1  # only `fresh` is held: the old one and the rejected went back


def test_an_aborted_verify_step_gives_its_fresh_id_back():
    store = SnapshotStore(2, FIRST_SNAPSHOT)
    snapshots = StateSnapshots(store, RadixCache(PAGE, PagePool(8), store), PAGE, None)
    seq = verifying_decode(3)
    seq.num_tree_pages, seq.token_ids, seq.pages = 0, [], []
    batch = ScheduledBatch(seqs=[seq], num_new_tokens=[3], positions=[3], num_decode=1, samples=[True],
                           draft_tokens=[DRAFTS])
    snapshots.plan(batch)
    assert seq.verified_snapshot is not None
    snapshots.release(seq)  # aborted while the step ran: never settled
    assert seq.verified_snapshot is None and store.num_free == store.num_snapshots


def test_the_runner_copies_the_kept_state_of_an_accepted_row_only():
    spec = RecurrentStateSpec(conv_shape=(2, 3), recurrent_shape=(1, 2, 2))
    cache = StateCache([spec], num_slots=4, dtype=torch.float32, device=torch.device("cpu"))
    speculation = StepSpeculation(cache, drafter=None)
    rows = 2 * (1 + len(DRAFTS))
    batch = SimpleNamespace(num_decode=rows, decode_groups=[1 + len(DRAFTS)] * 2)
    speculation.before_forward(batch, None)
    for row in range(rows):  # what the verify pass left after each row: the row's number, to tell them apart
        cache.kept_conv[:, row] = row + 1
        cache.kept_recurrent[:, row] = row + 1
    # decode 0 (slot 0) saves row 2 into snapshot 2, decode 1 (slot 1) row 1 into snapshot 3
    plan = SpeculationPlan(group_rows=[0, 3], group_drafts=[DRAFTS, DRAFTS], group_slots=[0, 1],
                           snapshot_saves=[(0, 2, 2), (1, 1, 3)])
    sampled = torch.tensor([7, 8, 9, 5, 0, 0])  # decode 0 keeps both drafts, decode 1 none
    assert speculation.after_sampling(plan, batch, torch.empty(0), sampled) is None
    conv, recurrent = cache.layer(0)
    assert torch.all(recurrent[2] == 3) and torch.all(conv[2] == 3)  # row 2 of decode 0
    assert torch.all(recurrent[3] == 0) and torch.all(conv[3] == 0)  # decode 1's row 1 was rejected: untouched
    assert torch.all(recurrent[1] == 4)  # decode 1 rolled back to its own token's row
    assert cache.kept_conv is None
