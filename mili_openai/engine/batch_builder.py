"""Turns a scheduled batch into the model's `ForwardBatch`: token ids, positions and KV slots.

Runs on the event loop thread (it reads sequence state the loop owns); per-token work is done with
tensor ops over page tables rather than Python loops over tokens.
"""

from __future__ import annotations

import torch

from mili_openai.engine.scheduler import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.model.batch import ForwardBatch, PrefillSegment


def _page_table(seqs: list[Sequence], width: int) -> torch.Tensor:
    """(len(seqs), width) int64 page ids, padded with page 0 (masked out by the caller)."""
    return torch.tensor([seq.pages + [0] * (width - len(seq.pages)) for seq in seqs], dtype=torch.int64)


def _slots(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    return pages[positions // page_size] * page_size + positions % page_size


def pending_inputs(batch: ScheduledBatch, sample_index: dict[Sequence, int]) -> tuple[list[int], list[int]]:
    """(rows, sources): the decode rows whose input token is still pending, and for each the index of
    its sequence among the sampled rows of the step before (`sample_index`), which is sampling it."""
    rows, sources = [], []
    for row, (seq, position) in enumerate(zip(batch.seqs[: batch.num_decode], batch.positions)):
        if position == seq.num_tokens:
            rows.append(row)
            sources.append(sample_index[seq])
    return rows, sources


def build_forward_batch(batch: ScheduledBatch, page_size: int) -> ForwardBatch:
    """The step's inputs; a decode whose token is pending gets 0 as its id (see `pending_inputs`)."""
    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slot_mapping: list[torch.Tensor] = []
    logits_indices: list[int] = []

    decode_seqs = batch.seqs[: batch.num_decode]
    decode_slots = decode_mask = ctx_lens = None
    if decode_seqs:
        ctx_lens = torch.tensor(batch.positions[: batch.num_decode], dtype=torch.int64) + 1
        max_pages = max(len(seq.pages) for seq in decode_seqs)
        table = _page_table(decode_seqs, max_pages)  # (Bd, P)
        offsets = torch.arange(page_size, dtype=torch.int64)
        all_slots = (table[:, :, None] * page_size + offsets).view(len(decode_seqs), -1)  # (Bd, P*ps)
        max_ctx = int(ctx_lens.max())
        decode_slots = all_slots[:, :max_ctx].contiguous()
        decode_mask = (torch.arange(max_ctx)[None, :] < ctx_lens[:, None])[:, None, None, :]
        last = ctx_lens - 1
        input_ids.extend(seq.token_ids[position] if position < seq.num_tokens else 0
                         for seq, position in zip(decode_seqs, batch.positions))
        positions.append(last)
        slot_mapping.append(decode_slots.gather(1, last[:, None]).squeeze(1))
        logits_indices.extend(range(len(decode_seqs)))

    prefills: list[PrefillSegment] = []
    row = len(decode_seqs)
    for index in range(batch.num_decode, len(batch.seqs)):
        seq, num_new, start = batch.seqs[index], batch.num_new_tokens[index], batch.positions[index]
        end = start + num_new
        if end > seq.num_tokens:
            raise RuntimeError("a prefill chunk reached a pending token: only decodes can feed one")
        pages = torch.tensor(seq.pages, dtype=torch.int64)
        context_slots = _slots(pages, torch.arange(end, dtype=torch.int64), page_size)
        input_ids.extend(seq.token_ids[start:end])
        positions.append(torch.arange(start, end, dtype=torch.int64))
        slot_mapping.append(context_slots[start:])
        prefills.append(PrefillSegment(start=row, length=num_new, context_slots=context_slots))
        row += num_new
        if batch.samples[index]:
            logits_indices.append(row - 1)

    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slot_mapping),
        num_decode=len(decode_seqs),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        decode_ctx_lens=ctx_lens if decode_seqs else None,
    )


def forward_batch_to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """Copy a CPU-built batch to the model's device (a no-op on CPU)."""
    if device.type == "cpu":
        return batch

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=move(batch.input_ids),
        positions=move(batch.positions),
        slot_mapping=move(batch.slot_mapping),
        num_decode=batch.num_decode,
        decode_slots=move(batch.decode_slots),
        decode_mask=move(batch.decode_mask),
        prefills=[PrefillSegment(p.start, p.length, move(p.context_slots)) for p in batch.prefills],
        logits_indices=move(batch.logits_indices),
        decode_ctx_lens=move(batch.decode_ctx_lens),
    )
