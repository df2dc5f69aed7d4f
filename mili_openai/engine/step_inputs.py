"""A step's inputs on their way to the GPU: one pinned host buffer, one asynchronous copy.

The builder (batch_builder.py) makes each input a small CPU tensor: token ids, positions, slots, page
tables. Copied one by one from pageable memory, each is a synchronous transfer the host waits on, a
dozen a step. `stage_forward_batch` packs them into one pinned buffer on the event loop thread, while the
step before runs; `forward_batch_to` then issues one non-blocking copy where the step launches and hands
the model views of the device buffer. torch's pinned allocator keeps a buffer out of reuse until the
copy that reads it has finished, so a fresh one per step is safe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mili_openai.model.batch import ForwardBatch, PageTables

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(batch: ForwardBatch, move: TensorMap) -> ForwardBatch:
    """A copy of `batch` with `move` applied to each of its index tensors (not `rotary`, which only the CPU
    path builds ahead)."""

    def apply(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else move(t)

    pages = batch.pages
    return ForwardBatch(
        input_ids=move(batch.input_ids),
        positions=move(batch.positions),
        slot_mapping=move(batch.slot_mapping),
        num_decode=batch.num_decode,
        decode_ctx_lens=apply(batch.decode_ctx_lens),
        prefills=list(batch.prefills),  # host ints only
        logits_indices=move(batch.logits_indices),
        pages=PageTables(pages.page_size, apply(pages.decode), apply(pages.prefill), apply(pages.prefill_cu_seqlens),
                         apply(pages.prefill_ctx_lens), pages.max_prefill_len),
        rotary=batch.rotary,
        state_slots=apply(batch.state_slots),
        vision=batch.vision,  # small host tensors: the model moves them
        decode_groups=batch.decode_groups,
    )


def stage_forward_batch(batch: ForwardBatch, pin_memory: bool = True) -> tuple[ForwardBatch, torch.Tensor]:
    """-> (the batch with every index tensor a view of one int64 buffer, pinned unless told otherwise, that
    buffer). The views stay writable through numpy (the runner feeds pending token ids into `input_ids`
    before the copy)."""
    tensors: list[torch.Tensor] = []
    map_tensors(batch, lambda t: tensors.append(t) or t)
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=torch.int64, pin_memory=pin_memory)
    host = buffer.numpy()
    offset = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        count = t.numel()
        host[offset : offset + count] = t.numpy().reshape(-1)
        view = buffer[offset : offset + count].view(t.shape)
        offset += count
        return view

    return map_tensors(batch, place), buffer


def forward_batch_to(batch: ForwardBatch, device: torch.device, staged: torch.Tensor | None = None) -> ForwardBatch:
    """The batch on the model's device (itself on CPU). `staged`: the pinned buffer `stage_forward_batch`
    packed the batch into, copied over in one transfer; without it each tensor is copied on its own."""
    if device.type == "cpu":
        return batch
    if staged is None:
        return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
    return views_of(batch, staged.to(device, non_blocking=True))


def views_of(staged_batch: ForwardBatch, buffer: torch.Tensor) -> ForwardBatch:
    """The staged batch's tensors as the same views of `buffer`, a copy of the staged buffer (on the GPU)."""
    return map_tensors(staged_batch, lambda t: buffer.as_strided(t.shape, t.stride(), t.storage_offset()))

