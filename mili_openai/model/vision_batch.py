"""The images of one forward step, as the model reads them, and the encoder cache.

`VisionBatch` rides on a `ForwardBatch` whenever a sequence with images runs in the step: every row's mRoPE
positions in three streams (rows of sequences without images repeat their position), the rows that hold image
tokens, and which embeddings go there (a slice of one image's merged patches each, in row order: a prefill chunk
may start or end inside an image). The model encodes each image the step needs, once: `ImageEmbeddingCache`
keeps the embeddings of the images seen most recently by their digest, so the later chunks of a prompt, a
preempted sequence's recompute and another request with the same image reuse them.

`mrope_rotary` turns three-stream positions into the (cos, signed_sin) the attention layers consume: each rotary
pair takes its angle from one stream, interleaved as transformers' `Qwen3_5TextRotaryEmbedding` recomposes them
(pair j reads height when j % 3 == 1 and j < 3 * sections[1], width when j % 3 == 2 and j < 3 * sections[2],
else temporal).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ENCODER_CACHE_IMAGES = 64  # images whose embeddings stay cached (a few MB each at Qwen3.5's shapes)


@dataclass(frozen=True, slots=True)
class ImagePiece:
    digest: str  # the image's content digest: the encoder cache's key
    pixel_values: Any  # (patches, patch_dim) float32, numpy or torch
    grid_thw: tuple[int, int, int]
    start: int  # the first of the image's merged-patch embeddings these rows take
    end: int


@dataclass(slots=True)
class VisionBatch:
    positions: torch.Tensor  # (3, T) int64: each row's position on the temporal, height and width streams
    rows: torch.Tensor  # (R,) int64: the rows that hold image tokens, in order
    pieces: list[ImagePiece]  # their embeddings: sum of (end - start) == R


class ImageEmbeddingCache:
    """Merged-patch embeddings by image digest, least recently used dropped past `capacity` images."""

    def __init__(self, capacity: int = ENCODER_CACHE_IMAGES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.images_encoded = 0

    def embeddings(self, pieces: list[ImagePiece],
                   encode: Callable[[list[torch.Tensor], list[tuple[int, int, int]]], list[torch.Tensor]]) -> torch.Tensor:
        """The pieces' embeddings, (R, ...) in order, as `encode` gives each image's (tokens, ...); the images not
        cached are encoded in one call."""
        missing: dict[str, ImagePiece] = {}
        for piece in pieces:
            if piece.digest not in self._entries:
                missing.setdefault(piece.digest, piece)
        if missing:
            encoded = encode([torch.as_tensor(p.pixel_values) for p in missing.values()],
                             [p.grid_thw for p in missing.values()])
            self.images_encoded += len(missing)
            for digest, embeddings in zip(missing, encoded):
                self._entries[digest] = embeddings
        found = []
        for piece in pieces:
            self._entries.move_to_end(piece.digest)
            found.append(self._entries[piece.digest][piece.start : piece.end])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return torch.cat(found)


def mrope_pair_streams(sections: tuple[int, ...], pairs: int) -> torch.Tensor:
    """(pairs,) int64: the position stream each rotary pair reads (0 temporal, 1 height, 2 width)."""
    streams = torch.zeros(pairs, dtype=torch.int64)
    for stream in (1, 2):
        streams[stream : 3 * sections[stream] : 3] = stream
    return streams


def mrope_rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, streams: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (3, T) -> (cos, signed_sin), (T, 1, rotary_dim) each in `dtype`, as `RotaryEmbedding` gives them
    for text (where the three streams are equal, this is exactly its output)."""
    freqs = positions.to(device=inv_freq.device, dtype=torch.float32)[..., None] * inv_freq  # (3, T, pairs)
    chosen = freqs.gather(0, streams.to(inv_freq.device).view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
    cos = (chosen.cos() * scaling).to(dtype)
    sin = (chosen.sin() * scaling).to(dtype)
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]
