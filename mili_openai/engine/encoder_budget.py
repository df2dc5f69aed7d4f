"""How much vision-encoder work one step may take: a cap on the patches of the images it encodes.

A prefill chunk that reaches an image's first placeholder token encodes that whole image in its step (the tower
attends over all of an image's patches at once; later chunks of the image find its embeddings cached). The chunks
of a step share `EncoderBudget`: a chunk is cut just before the first image the step has no patches left for, so
one request with many images spreads their encoding over several steps instead of stalling every decode in one.
The first image of a step is always taken, whatever its size: a step must make progress. A sequence admitted
from a prefix-cache hit that ends inside an image starts its first chunk there: that chunk encodes the image too.
"""

from __future__ import annotations

from mili_openai.engine.sequence import Sequence


class EncoderBudget:
    """The patches the images of one step may still encode."""

    def __init__(self, max_patches: int) -> None:
        self.left = max_patches
        self.images = 0  # images charged in this step

    def limit(self, seq: Sequence, num_new: int, admitted: bool = False) -> int:
        """seq's next chunk of `num_new` tokens, cut before the first image whose encoding it starts and the
        budget cannot take (possibly to 0); the images it keeps are charged. `admitted`: the chunk is the first
        since seq's admission, so an image it starts inside was not encoded by an earlier chunk."""
        if seq.images is None:
            return num_new
        start = seq.num_computed_tokens
        for image, first in zip(seq.images.images, seq.images.starts):
            inside = admitted and first < start < first + image.num_tokens
            if not (start <= first < start + num_new or inside):
                continue  # encoded by an earlier chunk, or not reached by this one
            t, h, w = image.grid_thw
            patches = t * h * w
            if self.images and patches > self.left:
                return max(first - start, 0)
            self.left = max(self.left - patches, 0)
            self.images += 1
        return num_new
