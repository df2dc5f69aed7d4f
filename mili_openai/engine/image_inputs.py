"""A request's images as the engine takes them, and where their tokens sit in the prompt (numpy only: the API side
builds these, and importing this module pulls in neither torch nor the model).

`ImageFeatures` is one preprocessed image: the image processor's patches and grid, and a digest of the decoded
pixels (the encoder cache's key). `RequestImages` places a request's images on its prompt: each image's
placeholder tokens (as many as the image has merged patches) and the mRoPE positions of every prompt token in
three streams (temporal, height, width), computed as transformers' `Qwen3_5Model.get_rope_index` does: text
tokens count up on all three streams; an image's tokens take (start + frame, start + row, start + column) over
its merged grid; the text after it continues from start + max(rows, columns). Tokens after the prompt (the
output) sit at their index plus `delta`, the same on every stream.

The prefix cache keys a prompt by its token ids, and an image's placeholder ids are the same whatever the image:
`RequestImages.key` writes over each image's placeholders one negative id derived from the image's digest (and the
LoRA adapter), so prompts with the same image share pages and state snapshots, and prompts with different images
part where the first image differs (SGLang pads its radix keys the same way; vLLM puts the hash in its block hash).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MROPE_STREAMS = 3  # temporal, height, width
TEXT_ONLY_MODEL = "images are not supported by this model: it takes text only (it has no vision tower)"
# an image's key id packs its digest above the adapter id (below 2**32, as LORA_KEY_STRIDE assumes of token ids)
IMAGE_KEY_ADAPTER_BITS = 32


@dataclass(frozen=True, slots=True, eq=False)
class ImageFeatures:
    pixel_values: np.ndarray  # (t * h * w patches, channels * temporal_patch * patch * patch) float32
    grid_thw: tuple[int, int, int]  # patches: frames / temporal_patch_size, rows, columns
    merge_size: int  # patches per merged token along each side
    digest: str  # sha256 of the decoded image and its preprocessing: equal digests, equal embeddings

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the image takes in the prompt: one per merged patch."""
        t, h, w = self.merged_grid
        return t * h * w


@dataclass(frozen=True, slots=True, eq=False)
class RequestImages:
    images: tuple[ImageFeatures, ...]
    starts: tuple[int, ...]  # prompt index of each image's first placeholder token
    positions: np.ndarray  # (3, prompt tokens) int64: the mRoPE position of each prompt token per stream
    delta: int  # an output token at index i sits at position i + delta on every stream

    def positions_of(self, start: int, count: int) -> np.ndarray:
        """(3, count) int64: the positions of tokens [start, start + count) of the sequence."""
        prompt_len = self.positions.shape[1]
        inside = self.positions[:, start : min(start + count, prompt_len)]
        after = np.arange(max(start, prompt_len), start + count, dtype=np.int64) + self.delta
        return np.concatenate((inside, np.broadcast_to(after, (MROPE_STREAMS, after.shape[0]))), axis=1)

    def key(self, key: list[int], lora_id: int) -> list[int]:
        """`key` (the cache key of the prompt's first len(key) tokens) with each image's placeholders replaced, in
        place, by the image's key id: negative, so never a text token's (even shifted by an adapter), and one per
        (digest, adapter) pair. Equal digests mean equal embeddings and positions, so equal K/V after them."""
        for image, first in zip(self.images, self.starts):
            end = min(first + image.num_tokens, len(key))
            if first >= end:
                break
            digest = int.from_bytes(image.digest.encode(), "big")
            image_id = -1 - ((digest << IMAGE_KEY_ADAPTER_BITS) | lora_id)
            key[first:end] = [image_id] * (end - first)
        return key

    def pieces_in(self, start: int, end: int) -> list[tuple[int, ImageFeatures, int, int]]:
        """The image tokens among prompt tokens [start, end): (first prompt index, image, first image token,
        end image token) per image they overlap, in order."""
        out = []
        for image, first in zip(self.images, self.starts):
            low, high = max(start, first), min(end, first + image.num_tokens)
            if low < high:
                out.append((low, image, low - first, high - first))
        return out


def _image_positions(image: ImageFeatures, start: int) -> np.ndarray:
    t, h, w = image.merged_grid
    frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack((frames, rows, cols)).reshape(MROPE_STREAMS, -1).astype(np.int64) + start


def place_images(prompt: list[int], image_token_id: int, images: list[ImageFeatures]) -> RequestImages:
    """Where `images` sit in `prompt` (runs of `image_token_id`, one image per run, in order) and every prompt
    token's mRoPE positions. ValueError when the placeholders do not match the images' token counts."""
    ids = np.asarray(prompt, dtype=np.int64)
    is_image = ids == image_token_id
    positions = np.empty((MROPE_STREAMS, len(prompt)), dtype=np.int64)
    starts: list[int] = []
    index = current = 0
    remaining = list(images)
    while index < len(prompt):
        if not is_image[index]:
            following = np.flatnonzero(is_image[index:])
            end = index + int(following[0]) if following.size else len(prompt)
            positions[:, index:end] = np.arange(end - index, dtype=np.int64) + current
            current += end - index
            index = end
            continue
        if not remaining:
            raise ValueError("the prompt has more image placeholder tokens than the request has images")
        image = remaining.pop(0)
        end = index + image.num_tokens
        if end > len(prompt) or not is_image[index:end].all():
            raise ValueError(f"an image needs {image.num_tokens} placeholder tokens in a row in the prompt")
        starts.append(index)
        positions[:, index:end] = _image_positions(image, current)
        _, rows, cols = image.grid_thw
        current += max(rows, cols) // image.merge_size
        index = end
    if remaining:
        raise ValueError(f"the request has {len(images)} images but the prompt places {len(starts)}")
    delta = int(positions.max()) + 1 - len(prompt) if len(prompt) else 0
    return RequestImages(tuple(images), tuple(starts), positions, delta)
