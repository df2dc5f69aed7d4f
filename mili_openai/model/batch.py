"""The inputs of one forward pass over a flattened batch of sequences.

The engine's runner builds it; the model only reads it. Token rows are ordered decode sequences first
(one token each), then prefill chunks (several tokens each). A KV *slot* is `page * page_size + offset`
in the flat per-layer cache of `KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in this chunk
    context_slots: torch.Tensor  # (ctx_len,) int64: slots of the cached prefix followed by this chunk


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64, where each token's K/V is written
    # rows [0, num_decode) are single-token decodes: one per sequence, or, for a sequence verifying draft
    # tokens, consecutive rows at consecutive positions (each attends to the rows before it)
    num_decode: int
    decode_slots: torch.Tensor | None  # (num_decode, max_ctx) int64 context slots, padded with 0
    # (num_decode,) int64 valid context of each decode row (slots past it are padding); None with decode_slots
    decode_ctx_lens: torch.Tensor | None
    prefills: list[PrefillSegment]  # rows [num_decode, T) in order; each attends causally to its context
    logits_indices: torch.Tensor  # (S,) int64 rows whose logits are wanted (decode rows, last token of sampled chunks)
    # (cos, signed_sin) of `positions`, (T, 1, D) each, where the builder computed them ahead (else the model does)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
