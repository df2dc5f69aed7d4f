"""Many LoRA adapters over one batch: the segmented gather-matmul of Punica (SGMV) in torch.

Rows are grouped by the adapter slot they run with, once per step; every LoRA projection then adds, for each
group, `x[rows] @ A[slot].T @ B[slot].T` into its output rows. Work is two small matmuls per adapter present in
the step (not per adapter loaded, nor a forward per adapter), and a batch that runs one adapter on all of its
rows skips the gather. The CPU kernels do the same per row in one call, with the same bf16 rounding
(kernels/csrc/lora_bf16.cpp), inside the compiled decode stack too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


SGMV_BLOCK_ROWS = 16  # rows of one slot a block holds in the Triton kernels' form (tl.dot's smallest tile side)


class LoraGroup(NamedTuple):
    slot: int  # the adapter's slot in the stacked weights
    rows: torch.Tensor | None  # (n,) int64 rows of the batch that run it; None: every row


class LoraSlotTable(NamedTuple):
    """One projection's adapter slots. A slot stacks n modules (a fused projection's): A rows [i R, (i + 1) R) are
    module i's (R = W / n), and its output columns [offsets[i], offsets[i + 1]) read only those rows of B^T."""

    lora_a: torch.Tensor  # (slots, W, in_features)
    lora_b: torch.Tensor  # (slots, W, out_features): B transposed, so a module's rows are its columns' whole delta
    offsets: tuple[int, ...]  # n + 1 output column boundaries, 0 first and out_features last


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


def slot_per_row(groups: list[LoraGroup], num_rows: int, device: torch.device) -> torch.Tensor:
    """(num_rows,) int64: each row's slot in `groups`, -1 for rows in none (the kernels' form of the groups)."""
    slots = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    for slot, rows in groups:
        if rows is None:
            slots.fill_(slot)
        else:
            slots.index_fill_(0, rows, slot)
    return slots


class LoraBlocks(NamedTuple):
    """The rows that run an adapter, in blocks of up to `block_rows` rows of one slot each (the Triton kernels'
    form of the groups, kernels/triton_lora.py): block i covers `order[first[i] : first[i] + count[i]]`."""

    order: torch.Tensor  # (N,) int64: the rows of every group, group after group
    first: torch.Tensor  # (blocks,) int32: each block's first position in `order`
    count: torch.Tensor  # (blocks,) int32: its rows, 1..block_rows
    slot: torch.Tensor  # (blocks,) int32: the slot every row of it runs


def lora_blocks(groups: list[LoraGroup], num_rows: int, block_rows: int, device: torch.device) -> LoraBlocks:
    """`groups` over a batch of `num_rows` rows cut into blocks of at most `block_rows` rows (sizes are read from
    the row tensors' shapes: no device sync)."""
    parts, table, position = [], [], 0
    for slot, rows in groups:
        rows = torch.arange(num_rows, device=device) if rows is None else rows
        parts.append(rows)
        size = rows.shape[0]
        table += [(position + start, min(block_rows, size - start), slot) for start in range(0, size, block_rows)]
        position += size
    columns = torch.tensor(table, dtype=torch.int32).reshape(-1, 3).T.contiguous().to(device, non_blocking=True)
    order = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    return LoraBlocks(order, columns[0], columns[1], columns[2])


class LoraRows:
    """One forward's rows by adapter slot, in the forms the LoRA ops take: `groups` (torch's segmented matmul),
    `per_row` (each row's slot, the CPU kernel's) and `blocks` (the Triton kernels'), the latter two made once,
    on first use, for every projection."""

    def __init__(self, groups: list[LoraGroup]) -> None:
        self.groups = groups
        self._per_row: torch.Tensor | None = None
        self._blocks: tuple[int, int, LoraBlocks] | None = None  # (num_rows, block_rows, blocks)

    @property
    def empty(self) -> bool:
        """No row runs an adapter: the ops may return at once."""
        return not self.groups

    def per_row(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self._per_row is None or self._per_row.shape[0] != num_rows:
            self._per_row = slot_per_row(self.groups, num_rows, device)
        return self._per_row

    def blocks(self, num_rows: int, block_rows: int, device: torch.device) -> LoraBlocks:
        if self._blocks is None or self._blocks[:2] != (num_rows, block_rows):
            self._blocks = (num_rows, block_rows, lora_blocks(self.groups, num_rows, block_rows, device))
        return self._blocks[2]


def max_lora_blocks(num_rows: int, num_slots: int, block_rows: int) -> int:
    """The most blocks `lora_blocks` cuts `num_rows` rows over `num_slots` slots into: a full block per `block_rows`
    rows, and at most one partial block per group."""
    return -(-num_rows // block_rows) + min(num_slots, num_rows)


class BucketLoraRows(LoraRows):
    """The rows by slot of a CUDA graph's bucket of `num_rows` decode rows: the Triton kernels' blocks in static
    buffers that each step's groups are copied into (`fill`), the blocks past the step's holding no row, so the
    captured launches serve any step; the torch and CPU forms come from the step's groups, as LoraRows'. It is
    never `empty`: a graph captured with the adapters' launches replays them, over no row where none runs one."""

    def __init__(self, num_rows: int, num_slots: int, block_rows: int, device: torch.device) -> None:
        super().__init__([])
        self.num_rows, self.block_rows = num_rows, block_rows
        size = max_lora_blocks(num_rows, num_slots, block_rows)
        self.static = LoraBlocks(torch.zeros(num_rows, dtype=torch.int64, device=device),
                                 *(torch.zeros(size, dtype=torch.int32, device=device) for _ in range(3)))

    @property
    def empty(self) -> bool:
        return False

    def fill(self, groups: list[LoraGroup], step_rows: int, device: torch.device) -> None:
        """The step's groups over its first `step_rows` rows (the rest are padding, on the base alone)."""
        self.groups, self._per_row = groups, None
        step = lora_blocks(groups, step_rows, self.block_rows, device)
        count = step.first.shape[0]
        self.static.order[: step.order.shape[0]].copy_(step.order)  # past them: unread (no block covers it)
        for static, values in zip(self.static[1:], step[1:]):
            static[:count].copy_(values)
        self.static.count[count:].zero_()

    def blocks(self, num_rows: int, block_rows: int, device: torch.device) -> LoraBlocks:
        if (num_rows, block_rows) != (self.num_rows, self.block_rows):
            raise ValueError(f"a bucket of {self.num_rows} rows in blocks of {self.block_rows} was asked for "
                             f"{num_rows} rows in blocks of {block_rows}")
        return self.static


def add_lora(out: torch.Tensor, x: torch.Tensor, table: LoraSlotTable, step_rows: LoraRows) -> torch.Tensor:
    """out (T, O) += x (T, I) @ A.T @ B.T per group, in place."""
    lora_a, lora_b = table.lora_a, table.lora_b
    for slot, rows in step_rows.groups:
        if rows is None:
            out.add_(x @ lora_a[slot].T @ lora_b[slot])  # (T, O)
        else:
            out.index_add_(0, rows, x.index_select(0, rows) @ lora_a[slot].T @ lora_b[slot])  # (n, O) into out
    return out
