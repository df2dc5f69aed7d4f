"""The forwards a model proposer runs right after a step's sampling (engine/mtp_drafter.py, engine/draft_model.py):
one over the step's kept rows (every prefill row, and each decode's rows up to its last accepted draft), and
chained ones of one decode row per drafting sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from mili_openai.engine.speculation import SpeculationPlan
from mili_openai.engine.structured_output import mask_rows
from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment


def proposes_for(plan: SpeculationPlan, index: int) -> bool:
    """Whether the proposer drafts for the batch's sequence `index` (SpeculationPlan.proposes_for)."""
    return plan.proposes_for is None or plan.proposes_for[index]


def kept_decode_rows(plan: SpeculationPlan, accepted: list[int]) -> tuple[list[int], list[int]]:
    """(the rows of each decode the proposer drafts for, up to its last accepted draft, in row order; how many
    rows each such decode keeps)."""
    rows: list[int] = []
    counts: list[int] = []
    for decode, (first, kept) in enumerate(zip(plan.group_rows, accepted)):
        if proposes_for(plan, decode):
            rows.extend(range(first, first + kept + 1))
            counts.append(kept + 1)
    return rows, counts


def drafted_sequences(plan: SpeculationPlan) -> tuple[list[int], list[int]]:
    """(the batch index of each sampled sequence the proposer drafts for, its index among the step's sampled
    sequences), decodes first, in logits order."""
    chosen = [(seq, order) for order, seq in enumerate(plan.sampled_seqs) if proposes_for(plan, seq)]
    return [seq for seq, _ in chosen], [order for _, order in chosen]


def taken_tokens(plan: SpeculationPlan, tokens: list[int], accepted: list[int], num_decode_rows: int,
                 sampled: list[int]) -> list[list[int]]:
    """Per sampled sequence of `sampled` (indices among the step's sampled sequences: decodes, then sampled
    chunks), the tokens the step keeps: a decode's accepted drafts and its sample, a chunk's sample. `tokens`:
    the step's samples in logits order."""
    taken = [tokens[first : first + kept + 1] for first, kept in zip(plan.group_rows, accepted)]
    taken += [[sample] for sample in tokens[num_decode_rows:]]
    return [taken[order] for order in sampled]


def kept_rows_batch(batch: ForwardBatch, decode_rows: list[int], decode_counts: list[int],
                    input_ids: torch.Tensor | None, logits_indices: torch.Tensor,
                    with_rotary: bool = True) -> tuple[ForwardBatch, torch.Tensor]:
    """The forward over `decode_rows` of `batch`'s decode rows (`decode_counts` per sequence), then every prefill
    row, reading `input_ids` (None: `batch`'s own ids of those rows) -> (that batch, the rows of `batch` it
    holds). with_rotary: keep `batch`'s rotary tables (a model with another RoPE computes its own)."""
    num_decode = len(decode_rows)
    shift = batch.num_decode - num_decode  # rejected drafts' rows are left out before the chunks
    segments = [PrefillSegment(segment.start - shift, segment.length, segment.context_len)
                for segment in batch.prefills]
    rows = torch.tensor(decode_rows + list(range(batch.num_decode, batch.num_tokens)), dtype=torch.int64)
    device = batch.positions.device
    rows_on_device, decode_index = rows.to(device), rows[:num_decode].to(device)
    rotary = None
    if batch.rotary is not None and with_rotary:
        rotary = (batch.rotary[0][rows_on_device], batch.rotary[1][rows_on_device])
    state_slots = None
    if batch.state_slots is not None:  # the decode rows' slots, then each chunk's
        slots = batch.state_slots
        state_slots = torch.cat((slots[decode_index.to(slots.device)], slots[batch.num_decode:]))
    pages = batch.pages
    if input_ids is None:
        input_ids = batch.input_ids[rows.to(batch.input_ids.device)]
    kept = ForwardBatch(
        input_ids=input_ids,
        positions=batch.positions[rows_on_device],
        slot_mapping=batch.slot_mapping[rows_on_device],
        num_decode=num_decode,
        decode_ctx_lens=batch.decode_ctx_lens[decode_index] if num_decode else None,
        prefills=segments,
        logits_indices=logits_indices,
        pages=PageTables(pages.page_size, pages.decode[decode_index] if num_decode else None, pages.prefill,
                         pages.prefill_cu_seqlens, pages.prefill_ctx_lens, pages.max_prefill_len),
        rotary=rotary,
        state_slots=state_slots,
        decode_groups=decode_counts if any(count > 1 for count in decode_counts) else None,
    )
    return kept, rows


def chain_batch(positions: list[int], pages: list[np.ndarray], page_size: int, device: torch.device,
                input_ids: torch.Tensor | None = None, state_slots: list[int] | None = None) -> ForwardBatch:
    """One decode row per sequence at `positions`, attending to its `pages` up to there, reading `input_ids` (None:
    zeros, for a module given its tokens apart). state_slots: each sequence's, for linear-attention layers."""
    width = max(position // page_size + 1 for position in positions)
    table = np.zeros((len(positions), width), dtype=np.int64)
    for row, page_list in enumerate(pages):
        count = min(width, len(page_list))
        table[row, :count] = page_list[:count]
    position = np.asarray(positions, dtype=np.int64)
    slots = table[np.arange(len(positions)), position // page_size] * page_size + position % page_size

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return ForwardBatch(
        input_ids=on_device(np.zeros(len(positions), dtype=np.int64)) if input_ids is None else input_ids,
        positions=on_device(position), slot_mapping=on_device(slots), num_decode=len(positions),
        decode_ctx_lens=on_device(position + 1), prefills=[],
        logits_indices=on_device(np.arange(len(positions), dtype=np.int64)),
        pages=PageTables(page_size, on_device(table), None, None, None, 0),
        state_slots=None if state_slots is None else on_device(np.asarray(state_slots, dtype=np.int64)),
    )


def has_page_at(position: int, pages: np.ndarray, page_size: int) -> bool:
    """Whether a sequence holding `pages` has a slot at `position` (chained drafts stop where it has none)."""
    return position // page_size < len(pages)


def mask_by_formats(logits: torch.Tensor, grammars: list, taken: list[list[int]]) -> list[bool]:
    """Mask each row of a model's draft logits (R, V) as its sequence's structured output masks its target rows
    (None: no format), after the tokens `taken` since its matcher's state (the step's kept tokens, then the row's
    drafts before) -> per row, whether the format leaves it any token (else its chain stops)."""
    allowed = [True] * len(grammars)
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.masks_after(taken[row])]
    if rows:
        mask_rows(logits, rows, [grammars[row] for row in rows], [taken[row] for row in rows])
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        for row, any_left in zip(rows, torch.isfinite(logits[index]).any(dim=-1).tolist()):
            allowed[row] = any_left
    return allowed


def take_drafts(plan: SpeculationPlan, owners: list[int], live: list[int], logits: torch.Tensor, token: torch.Tensor,
                taken: list[list[int]] | None, drafts: list[list[int]]) -> list[int]:
    """The argmax of each live row's `logits` (R, V) into `token` (indexed by row of `owners`) and the drafts of
    its sequence, batch index `owners[i]`; a structured output masks it first, after the tokens the step `taken`
    and its drafts so far (None: no format in the step) -> the rows still drafting (a format may leave none)."""
    allowed = [True] * len(live)
    if taken is not None:
        allowed = mask_by_formats(logits, [plan.grammars[owners[i]] for i in live],
                                  [taken[i] + drafts[owners[i]] for i in live])
    index = torch.tensor(live, dtype=torch.int64, device=token.device)
    token[index] = logits.argmax(dim=-1)
    for i, draft, draws in zip(live, token[index].tolist(), allowed):
        if draws:
            drafts[owners[i]].append(draft)
    return [i for i, draws in zip(live, allowed) if draws]
