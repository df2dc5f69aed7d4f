"""Many LoRA adapters over one batch: the segmented gather-matmul of Punica (SGMV) in torch.

Rows are grouped by the adapter slot they run with, once per step; every LoRA projection then adds, for each
group, `x[rows] @ A[slot].T @ B[slot].T` into its output rows. Work is two small matmuls per adapter present in
the step (not per adapter loaded, nor a forward per adapter), and a batch that runs one adapter on all of its
rows skips the gather.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LoraGroup(NamedTuple):
    slot: int  # the adapter's slot in the stacked weights
    rows: torch.Tensor | None  # (n,) int64 rows of the batch that run it; None: every row


def lora_groups(row_slots: list[int], device: torch.device) -> list[LoraGroup]:
    """The groups of a step's rows (`row_slots`: each row's slot, -1 for rows on the base model alone)."""
    slots = sorted(set(row_slots) - {-1})
    if len(slots) == 1 and -1 not in row_slots:
        return [LoraGroup(slots[0], None)]
    groups = []
    for slot in slots:
        rows = [row for row, row_slot in enumerate(row_slots) if row_slot == slot]
        groups.append(LoraGroup(slot, torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)))
    return groups


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             groups: list[LoraGroup]) -> torch.Tensor:
    """out (T, O) += x (T, I) @ A.T @ B.T per group, in place; lora_a (slots, R, I), lora_b (slots, O, R)."""
    for slot, rows in groups:
        if rows is None:
            out.add_(x @ lora_a[slot].T @ lora_b[slot].T)  # (T, O)
        else:
            out.index_add_(0, rows, x.index_select(0, rows) @ lora_a[slot].T @ lora_b[slot].T)  # (n, O) into out
    return out
