"""Shared by the image tests: a tiny random Qwen3.5 vision-language checkpoint that speaks Qwen3.5's format (its
248,320-row vocabulary, so the placeholder ids exist; tokenizer, chat template, end-of-turn ids), test images
drawn on the fly, and prompts with placeholders laid out as the chat template and processor lay them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

VISION_SEED = 15
# several sizes and aspect ratios: below the minimum pixel count (upscaled), wide, tall
IMAGE_SIZES = ((64, 48), (300, 120), (90, 260))


def build_vision_checkpoint(path: Path) -> Path:
    from hybrid_helpers import TINY_HYBRID_CONFIG

    from mili_openai.model.hybrid_checkpoint import QWEN35_TOKENIZER, build_random_hybrid_checkpoint
    from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE

    fields = TINY_HYBRID_CONFIG | dict(vocab_size=QWEN35_VOCAB_SIZE, tie_word_embeddings=True)
    return build_random_hybrid_checkpoint(path, "qwen3_5_vl", fields, seed=VISION_SEED, tokenizer=QWEN35_TOKENIZER)


def drawn_image(width: int, height: int, seed: int):
    """An RGB PIL image with structure (gradients and blocks), so resizing and patching matter."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                       ((x // 8 + y // 8) % 2) * 200], axis=-1).astype(np.int64)
    pixels = (pixels + rng.integers(0, 40, size=pixels.shape)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_bytes(image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()
