"""The compiled decode stack's Python face: every decoder layer of a decode-only step in one call, with the LoRA
slots of its linears where adapters are served (kernels/csrc/decode_stack.cpp)."""

from __future__ import annotations

from typing import Protocol

import torch

from mili_openai.kernels.lora import LoraSlotTable


class StackKernels(Protocol):
    """What a stack asks of the kernels that built it (mili_openai.kernels.CpuKernels)."""

    @property
    def max_kernel_rows(self) -> int: ...

    def lora_projection(self, table: LoraSlotTable | None): ...


class CpuDecodeStack:
    """The compiled decoder layers for decode steps of up to `max_rows` sequences (the rows the matmul
    kernel takes; a larger batch goes layer by layer, where its matmuls are GEMMs)."""

    def __init__(self, stack, kernels: StackKernels) -> None:
        self._stack = stack
        self.kernels = kernels
        self._no_lora_slots = torch.empty(0, dtype=torch.int64)

    @property
    def max_rows(self) -> int:
        return self.kernels.max_kernel_rows

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pools: torch.Tensor,
                slot_mapping: torch.Tensor, page_table: torch.Tensor, page_size: int,
                ctx_lens: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B,) -> (B, hidden) after the last layer, K/V written to `pools`, each row attending to
        positions [0, ctx_lens[b]) of its page table row, and adding the delta of LoRA slot lora_slots[b] (-1: none)
        where `set_lora` gave slots. One call that runs no torch op from Python: the GIL is held until it is
        released for the whole stack."""
        return self._stack.forward(input_ids, cos, signed_sin, pools, slot_mapping, page_table, page_size, ctx_lens,
                                   self._no_lora_slots if lora_slots is None else lora_slots)

    def set_lora(self, projections: list[LoraSlotTable | None]) -> None:
        """LoRA adapter slots on the stack's linears, one entry per linear in the order `decode_stack` took them
        (None: that linear takes none). Held, not copied: adapters loaded into the slots later are read as they are."""
        self._stack.set_lora([self.kernels.lora_projection(table) for table in projections])
