"""Turns a scheduled batch into the model's `ForwardBatch`: token ids, positions, KV slots and page tables.

Runs on the event loop thread (it reads sequence state the loop owns), once per step, for every token of
the step. It works in numpy and hands torch the finished arrays (`torch.from_numpy` shares them): a
torch op costs the loop an order of magnitude more dispatch than a numpy op, and the loop preempts one
of the forward's two threads while it runs. Per-token work stays in array ops over page tables, never
in Python loops over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mili_openai.engine.pooling_spec import PoolingRow
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Prompt tokens a prefill chunk scores (params.prompt_logprobs): the hidden rows [row, row +
    len(targets)) predict prompt tokens `targets`, the first of which is prompt token `first`."""

    batch_index: int  # the sequence's place in the batch
    row: int
    first: int
    targets: list[int]
    top_k: int


def prompt_scorings(batch: ScheduledBatch, forward_batch: ForwardBatch) -> list[PromptScoring]:
    """The prefill chunks' prompt tokens to score (rows from `forward_batch`'s segments). The row at
    position p predicts token p + 1, so a chunk over positions [start, end) scores prompt tokens start + 1
    .. min(end, prompt length - 1); the last prompt position predicts the first output token, which is
    sampled, not scored."""
    scorings = []
    for index, segment in enumerate(forward_batch.prefills, start=batch.num_decode):
        seq, start = batch.seqs[index], batch.positions[index]
        top_k = seq.params.prompt_logprobs
        stop = min(start + segment.length, seq.num_prompt_tokens - 1)
        if top_k is not None and stop > start:
            targets = seq.prompt_token_ids[start + 1 : stop + 1]
            scorings.append(PromptScoring(index, segment.start, start + 1, targets, top_k))
    return scorings


def pooling_rows(batch: ScheduledBatch, forward_batch: ForwardBatch) -> list[PoolingRow]:
    """The prefill chunks of pooling requests (engine/pooling_spec.py), with their rows in `forward_batch`."""
    rows = []
    for index, segment in enumerate(forward_batch.prefills, start=batch.num_decode):
        seq, start = batch.seqs[index], batch.positions[index]
        if seq.pooled:
            rows.append(PoolingRow(index, segment.start, segment.length, start,
                                   final=start + segment.length == seq.num_prompt_tokens))
    return rows


class PageArrays:
    """Each decoding sequence's page list as an int64 array, kept from one step to the next: a decode's
    pages change once in `page_size` steps, and converting a Python list of ints into the step's page
    table costs the loop thread more per sequence than the rest of that table. An entry is served only
    while the list still equals the copy it was built from (one C-speed comparison), so a new page or a
    preemption is never missed; sequences left out of a step are dropped."""

    def __init__(self) -> None:
        self._entries: dict[Sequence, tuple[list[int], np.ndarray]] = {}

    def of(self, seqs: list[Sequence]) -> list[np.ndarray]:
        """The page arrays of `seqs`, in order; forgets every other sequence."""
        previous, entries = self._entries, {}
        arrays = []
        for seq in seqs:
            entry = previous.get(seq)
            if entry is None or entry[0] != seq.pages:
                entry = (list(seq.pages), np.array(seq.pages, dtype=np.int64))
            entries[seq] = entry
            arrays.append(entry[1])
        self._entries = entries
        return arrays


class _DecodeRows:
    """The decode rows' inputs: a sequence's row at `position` attends to positions [0, position]. A decode
    with drafts has a row for its last token and one for each draft, at consecutive positions, all reading
    its page table (each row sees the K/V the rows before it write in the same layer)."""

    def __init__(self, batch: ScheduledBatch, page_size: int, page_arrays: PageArrays) -> None:
        num_decode = batch.num_decode
        seqs, starts = batch.seqs[:num_decode], batch.positions[:num_decode]
        counts = batch.num_new_tokens[:num_decode]
        num_rows = sum(counts)
        if num_rows == num_decode:  # no drafts: one row per sequence
            self.positions = np.asarray(starts, dtype=np.int64)
            seq_of_row = None
        else:
            seq_of_row = np.repeat(np.arange(num_decode), counts)
            offset_in_seq = np.arange(num_rows) - (np.cumsum(counts) - counts)[seq_of_row]
            self.positions = np.asarray(starts, dtype=np.int64)[seq_of_row] + offset_in_seq
        self.ctx_lens = self.positions + 1  # (rows,)
        width = -(-int(self.ctx_lens.max()) // page_size)  # pages that cover the longest context
        table = np.zeros((num_decode, width), dtype=np.int64)  # padded with page 0 (never read)
        for index, pages in enumerate(page_arrays.of(seqs)):
            pages = pages[:width]
            table[index, : len(pages)] = pages
        if seq_of_row is not None:
            table = table[seq_of_row]
        self.table = table  # (rows, width)
        self.slot_mapping = (table[np.arange(num_rows), self.positions // page_size] * page_size
                             + self.positions % page_size)
        # a token still being sampled by the step before gets 0 here (engine/pending_tokens.py)
        self.input_ids = [seq.token_ids[p] if p < len(seq.token_ids) else 0 for seq, p in zip(seqs, starts)]
        if seq_of_row is not None:
            self.input_ids = [token for first, drafts in zip(self.input_ids, batch.draft_tokens)
                              for token in (first, *drafts)]


def build_forward_batch(batch: ScheduledBatch, page_size: int, page_arrays: PageArrays | None = None) -> ForwardBatch:
    """The step's inputs; a decode whose token is pending gets 0 as its id (engine/pending_tokens.py).
    page_arrays: the decodes' page arrays kept from the step before (built afresh without it)."""
    num_decode = batch.num_decode
    decode = _DecodeRows(batch, page_size, page_arrays or PageArrays()) if num_decode else None
    input_ids: list[int] = decode.input_ids if decode else []
    positions: list[np.ndarray] = [decode.positions] if decode else []
    slot_mapping: list[np.ndarray] = [decode.slot_mapping] if decode else []
    num_decode_rows = len(input_ids)
    logits_indices: list[int] = list(range(num_decode_rows))  # every decode row samples (drafts are verified)

    prefills: list[PrefillSegment] = []
    prefill_pages: list[list[int]] = []  # each chunk's pages up to its end
    row = num_decode_rows
    for index in range(num_decode, len(batch.seqs)):
        seq, num_new, start = batch.seqs[index], batch.num_new_tokens[index], batch.positions[index]
        end = start + num_new
        if end > seq.num_tokens:
            raise RuntimeError("a prefill chunk reached a pending token: only decodes can feed one")
        input_ids.extend(seq.token_ids[start:end])
        chunk_positions = np.arange(start, end, dtype=np.int64)
        positions.append(chunk_positions)
        chunk_pages = seq.pages[: -(-end // page_size)]
        prefill_pages.append(chunk_pages)
        slot_mapping.append(np.asarray(chunk_pages, dtype=np.int64)[chunk_positions // page_size] * page_size
                            + chunk_positions % page_size)
        prefills.append(PrefillSegment(start=row, length=num_new, context_len=end))
        row += num_new
        if batch.samples[index]:
            logits_indices.append(row - 1)

    # one per decode row (a decode verifying drafts repeats its slot), then one per chunk
    state_slots = None
    decode_groups = batch.num_new_tokens[:num_decode] if num_decode_rows > num_decode else None
    if batch.seqs[0].state_slot is not None:
        slots = np.array([seq.state_slot for seq in batch.seqs], dtype=np.int64)
        if decode_groups is not None:
            slots = np.concatenate((np.repeat(slots[:num_decode], decode_groups), slots[num_decode:]))
        state_slots = torch.from_numpy(slots)
    return ForwardBatch(
        input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
        positions=torch.from_numpy(np.concatenate(positions)),
        slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)),
        num_decode=num_decode_rows,
        decode_ctx_lens=torch.from_numpy(decode.ctx_lens) if decode else None,
        prefills=prefills,
        logits_indices=torch.from_numpy(np.array(logits_indices, dtype=np.int64)),
        pages=_page_tables(page_size, decode, prefills, prefill_pages),
        state_slots=state_slots,
        decode_groups=decode_groups,
    )


def row_lora_ids(batch: ScheduledBatch) -> np.ndarray | None:
    """Each row's LoRA adapter id (a decode's draft rows and a chunk's rows repeat their sequence's); None when
    no sequence of the step runs an adapter."""
    ids = [seq.lora_id for seq in batch.seqs]
    return np.repeat(np.asarray(ids, dtype=np.int64), batch.num_new_tokens) if any(ids) else None


def _page_tables(page_size: int, decode: _DecodeRows | None, prefills: list[PrefillSegment],
                 prefill_pages: list[list[int]]) -> PageTables:
    """The step's page tables: the decode rows' (built with them), then one row per prefill chunk."""
    prefill_table = cu_seqlens = ctx_lens = None
    if prefills:
        prefill_table = np.zeros((len(prefills), max(len(pages) for pages in prefill_pages)), dtype=np.int64)
        for index, pages in enumerate(prefill_pages):
            prefill_table[index, : len(pages)] = pages
        lengths = np.asarray([segment.length for segment in prefills], dtype=np.int64)
        cu_seqlens = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths))))
        ctx_lens = torch.from_numpy(np.asarray([segment.context_len for segment in prefills], dtype=np.int64))
        prefill_table = torch.from_numpy(prefill_table)
    return PageTables(
        page_size=page_size,
        decode=torch.from_numpy(decode.table) if decode is not None else None,
        prefill=prefill_table,
        prefill_cu_seqlens=cu_seqlens,
        prefill_ctx_lens=ctx_lens,
        max_prefill_len=max((segment.length for segment in prefills), default=0),
    )
