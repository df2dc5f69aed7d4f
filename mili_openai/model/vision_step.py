"""What the language models read of a step's images (model/vision_batch.py): `step_image_embeddings`, the embeddings
of the step's image rows through the encoder cache, and `step_rotary`, every row's (cos, signed_sin): mRoPE's from
three position streams when a sequence with images runs, the plain table's otherwise."""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.model.batch import ForwardBatch
from mili_openai.model.vision_batch import ImageEmbeddingCache, mrope_rotary


def step_image_embeddings(batch: ForwardBatch, visual: nn.Module | None, cache: ImageEmbeddingCache,
                          architecture: str) -> torch.Tensor | None:
    """(R, embeddings per token, hidden) for the step's image rows (the tower's `encode`, model/qwen3_5_vision.py),
    None when no prefill chunk of the step covers image tokens; ValueError for a model without a tower."""
    if batch.vision is None or not batch.vision.pieces:
        return None
    if visual is None:
        raise ValueError(f"{architecture} has no vision tower: it cannot take images")
    return cache.embeddings(batch.vision.pieces, visual.encode)


def step_rotary(batch: ForwardBatch, rotary_emb: nn.Module, streams: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), (T, 1, rotary_dim) each: from every row's three position streams when a sequence with
    images runs, else from the text positions (or as the batch builder computed them ahead)."""
    if batch.vision is not None:
        return mrope_rotary(batch.vision.positions, rotary_emb.inv_freq, rotary_emb.attention_scaling, streams, dtype)
    return batch.rotary if batch.rotary is not None else rotary_emb(batch.positions, dtype)
