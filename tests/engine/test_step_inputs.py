"""A step's inputs as page tables, which every attention path reads, and packed for one copy to the GPU.

The page tables must address exactly each row's context: decode rows (drafts included), and prefill chunks
after a cached prefix. Packing must hand the model the same values, as views of one buffer that the runner
can still write pending token ids into.
"""

from __future__ import annotations

import torch

from mili_openai.engine.batch_builder import PageArrays, build_forward_batch
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.step_inputs import map_tensors, stage_forward_batch, views_of
from mili_openai.kernels.attention_reference import context_slots
from mili_openai.model.batch import ForwardBatch

PAGE_SIZE = 4


def sequence(name: str, length: int, pages: list[int]) -> Sequence:
    seq = Sequence(sequence_id=name, prompt_token_ids=list(range(100, 100 + length)),
                   params=SamplingParams(max_tokens=8), max_tokens=8, arrival_time=0.0, detokenizer=None,
                   stop_matcher=None, generator=None)
    seq.pages = pages
    return seq


def mixed_batch() -> ScheduledBatch:
    """A decode, a decode verifying two drafts, a chunk after a 6-token cached prefix, a whole short prompt;
    pages scattered."""
    decode = sequence("decode", 9, [7, 2, 11])
    drafting = sequence("drafting", 6, [5, 0])
    chunked = sequence("chunked", 20, [9, 3, 14, 1])
    short = sequence("short", 3, [6])
    return ScheduledBatch(seqs=[decode, drafting, chunked, short], num_new_tokens=[1, 3, 10, 3],
                          positions=[8, 5, 6, 0], num_decode=2, samples=[True, True, False, True],
                          draft_tokens=[[], [42, 43]])


def slot_of(pages: list[int], position: int) -> int:
    return pages[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE


def test_page_tables_address_each_rows_context():
    """Decode rows (drafts included) and prefill chunks after a cached prefix read, through their page
    table rows, exactly the slots of their sequences' positions; new tokens are written to theirs."""
    scheduled = mixed_batch()
    batch = build_forward_batch(scheduled, PAGE_SIZE)
    decode, drafting, chunked, short = scheduled.seqs
    # (sequence, position) of each row: a decode, a decode with two drafts, a chunk at 6..15, a short prompt
    rows = [(decode, 8), *((drafting, p) for p in (5, 6, 7)), *((chunked, p) for p in range(6, 16)),
            *((short, p) for p in range(3))]
    assert batch.positions.tolist() == [p for _, p in rows]
    assert batch.slot_mapping.tolist() == [slot_of(seq.pages, p) for seq, p in rows]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 16]  # decode rows and the short prompt's last
    pages = batch.pages
    assert pages.page_size == PAGE_SIZE and pages.decode.shape[0] == batch.num_decode == 4  # 1 + (1 + 2 drafts)
    assert batch.decode_ctx_lens.tolist() == [9, 6, 7, 8]
    for row, (seq, position) in enumerate(rows[:4]):
        want = [slot_of(seq.pages, p) for p in range(position + 1)]
        assert context_slots(pages.decode[row], PAGE_SIZE, position + 1).tolist() == want
    assert pages.prefill_cu_seqlens.tolist() == [0, 10, 13] and pages.prefill_ctx_lens.tolist() == [16, 3]
    assert pages.max_prefill_len == 10
    assert [(s.start, s.length, s.context_len) for s in batch.prefills] == [(4, 10, 16), (14, 3, 3)]
    for row, seq in enumerate((chunked, short)):
        ctx = int(pages.prefill_ctx_lens[row])
        assert context_slots(pages.prefill[row], PAGE_SIZE, ctx).tolist() == [slot_of(seq.pages, p) for p in range(ctx)]


def test_page_arrays_kept_across_steps_follow_every_change_of_a_page_list():
    """Steps built with one `PageArrays` address the slots fresh ones do, as a decode gains a page, another
    is preempted and comes back with other pages of the same count, and one leaves the batch and returns."""
    page_arrays = PageArrays()
    first, second = sequence("first", 8, [7, 2]), sequence("second", 6, [5, 0])
    page_lists = [([7, 2], [5, 0]), ([7, 2, 11], [5, 0]), ([7, 2, 11], [3, 1]), ([7, 2, 11, 4], [3, 1])]
    for step, (first_pages, second_pages) in enumerate(page_lists):
        first.pages, second.pages = first_pages, second_pages
        seqs = [first, second] if step != 2 else [second]  # first sits out a step
        positions = [4 * len(seq.pages) - 1 for seq in seqs]
        batch = ScheduledBatch(seqs=seqs, num_new_tokens=[1] * len(seqs), positions=positions,
                               num_decode=len(seqs), samples=[True] * len(seqs), draft_tokens=[[] for _ in seqs])
        kept = build_forward_batch(batch, PAGE_SIZE, page_arrays)
        fresh = build_forward_batch(batch, PAGE_SIZE)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        collect(kept, fresh, pairs)
        assert pairs and all(torch.equal(got, want) for got, want in pairs)
        first.pages = list(first.pages)  # a new list object with the same pages: still served right


def test_staged_inputs_are_views_of_one_buffer_with_the_same_values():
    batch = build_forward_batch(mixed_batch(), PAGE_SIZE)
    expected = map_tensors(batch, torch.clone)
    staged, buffer = stage_forward_batch(batch, pin_memory=False)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    collect(staged, expected, pairs)
    for got, want in pairs:
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(got, want)
    staged.input_ids.numpy()[1] = 7  # the runner feeds a pending token after staging
    moved = views_of(staged, buffer.clone())  # as the GPU copy is
    pairs.clear()
    collect(moved, staged, pairs)
    assert all(torch.equal(got, want) for got, want in pairs) and int(moved.input_ids[1]) == 7
    assert moved.pages.max_prefill_len == 10 and moved.prefills == batch.prefills


def collect(batch: ForwardBatch, other: ForwardBatch, pairs: list) -> None:
    """(batch's tensor, other's) for every index tensor, in map_tensors' order."""
    mine: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    map_tensors(batch, lambda t: mine.append(t) or t)
    map_tensors(other, lambda t: theirs.append(t) or t)
    assert len(mine) == len(theirs) and mine
    pairs.extend(zip(mine, theirs))
    assert all(m.shape == t.shape for m, t in zip(mine, theirs))
