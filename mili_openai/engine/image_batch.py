"""A step's images for the model (`VisionBatch`, model/vision_batch.py), from the sequences the scheduler picked:
every row's mRoPE positions (a sequence without images at its own position on all three streams), and, for the
prefill chunks that cover image placeholder tokens, which rows take which slice of which image's embeddings.
Rows are laid out as `build_forward_batch` lays them: each sequence's new tokens in batch order."""

from __future__ import annotations

import numpy as np
import torch

from mili_openai.engine.image_inputs import MROPE_STREAMS
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.model.vision_batch import ImagePiece, VisionBatch


def vision_batch(batch: ScheduledBatch) -> VisionBatch | None:
    """None when no sequence of the step has images (the model then runs text positions as before)."""
    if all(seq.images is None for seq in batch.seqs):
        return None
    positions: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    pieces: list[ImagePiece] = []
    row = 0
    for seq, start, count in zip(batch.seqs, batch.positions, batch.num_new_tokens):
        images = seq.images
        if images is None:
            positions.append(np.broadcast_to(np.arange(start, start + count, dtype=np.int64), (MROPE_STREAMS, count)))
        else:
            positions.append(images.positions_of(start, count))
            for first, image, low, high in images.pieces_in(start, start + count):
                rows.append(np.arange(high - low, dtype=np.int64) + row + first - start)
                pieces.append(ImagePiece(image.digest, image.pixel_values, image.grid_thw, low, high))
        row += count
    image_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return VisionBatch(torch.from_numpy(np.concatenate(positions, axis=1)), torch.from_numpy(image_rows), pieces)
