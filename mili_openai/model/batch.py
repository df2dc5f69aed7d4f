"""The inputs of one forward pass over a flattened batch of sequences.

The engine's runner builds it; the model only reads it. Token rows are ordered decode sequences first
(one token each), then prefill chunks (several tokens each). A KV *slot* is `page * page_size + offset`
in the flat per-layer cache of `KVCache`; every attention path (the CPU and Triton kernels, torch's SDPA)
reads a context through its page table (`PageTables`), every decode row in one call and every prefill
chunk in one more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mili_openai.model.vision_batch import VisionBatch


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in this chunk
    context_len: int  # tokens of the cached prefix followed by this chunk


@dataclass(slots=True)
class PageTables:
    """The step's contexts as page tables, built once per step for every layer: position p of a context
    is at slot `table[p // page_size] * page_size + p % page_size`. Tables are int64, padded with page 0
    past each context (never read)."""

    page_size: int
    decode: torch.Tensor | None  # (decode rows, W): each decode row's pages (rows with drafts repeat them)
    prefill: torch.Tensor | None  # (segments, W): each prefill chunk's pages, its cached prefix included
    # (segments + 1,) int64: segment s has rows [cu[s], cu[s + 1]) counted from the first prefill row
    prefill_cu_seqlens: torch.Tensor | None
    prefill_ctx_lens: torch.Tensor | None  # (segments,) int64: context length after each chunk
    max_prefill_len: int = 0  # the longest chunk (sizes the Triton extend kernel's grid)


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64, where each token's K/V is written
    # rows [0, num_decode) are single-token decodes: one per sequence, or, for a sequence verifying draft
    # tokens, consecutive rows at consecutive positions (each attends to the rows before it)
    num_decode: int
    # (num_decode,) int64 context of each decode row, itself included; None without decodes
    decode_ctx_lens: torch.Tensor | None
    prefills: list[PrefillSegment]  # rows [num_decode, T) in order; each attends causally to its context
    logits_indices: torch.Tensor  # (S,) int64 rows whose logits are wanted (decode rows, last token of sampled chunks)
    pages: PageTables  # every row's context
    # (cos, signed_sin) of `positions`, (T, 1, D) each, where the builder computed them ahead (else the model does)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    # (num_decode + len(prefills),) int64: the state slot (model/state_cache.py) of each decode row, then of
    # each prefill chunk, in batch order; None for a model without linear-attention layers
    state_slots: torch.Tensor | None = None
    # the step's images (model/vision_batch.py): mRoPE positions of every row, image rows and their embeddings;
    # None when no sequence with images runs
    vision: VisionBatch | None = None
    # rows of each decoding sequence where some verify drafts (1 + its drafts), host ints; None: one row each.
    # A linear layer runs a sequence's rows one after another over its one state (model/gated_deltanet.py)
    decode_groups: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
