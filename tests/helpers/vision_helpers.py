"""Shared by the image tests: a tiny random Qwen3.5 vision-language checkpoint that speaks Qwen3.5's format (its
248,320-row vocabulary, so the placeholder ids exist; tokenizer, chat template, end-of-turn ids) and its MoE twin, a tiny random
Qwen3-VL one (Qwen3's vocabulary and tokenizer, which hold its placeholder ids; two DeepStack layers) and its MoE
twin, test images
drawn on the fly, and prompts with placeholders laid out as the chat template and processor lay them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

VISION_SEED = 15
VISION_MOE_SEED = 18
# several sizes and aspect ratios: below the minimum pixel count (upscaled), wide, tall
IMAGE_SIZES = ((64, 48), (300, 120), (90, 260))
QWEN3_VL_SEED = 16
# Qwen3-VL's layout at tiny sizes: 3 decoder layers (DeepStack adds after the first two), head_dim 32 != 64 / 4,
# mRoPE sections [6, 5, 5] over the 16 rotary pairs (as [24, 20, 20] over 64), a 3-block tower
TINY_QWEN3_VL_TEXT = dict(
    vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[6, 5, 5], mrope_interleaved=True))
TINY_QWEN3_VL_VISION = dict(depth=3, deepstack_visual_indexes=[0, 2])
QWEN3_VL_MOE_SEED = 17
# Qwen3-VL-MoE: the same with 4 experts of 48 (so no stacked expert is square: its stored layout shows), top 2,
# and layer 1 dense (mlp_only_layers)
TINY_QWEN3_VL_MOE_TEXT = TINY_QWEN3_VL_TEXT | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                   mlp_only_layers=[1])


def build_vision_checkpoint(path: Path) -> Path:
    from hybrid_helpers import TINY_HYBRID_CONFIG

    from mili_openai.model.hybrid_checkpoint import QWEN35_TOKENIZER, build_random_hybrid_checkpoint
    from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE

    fields = TINY_HYBRID_CONFIG | dict(vocab_size=QWEN35_VOCAB_SIZE, tie_word_embeddings=True)
    return build_random_hybrid_checkpoint(path, "qwen3_5_vl", fields, seed=VISION_SEED, tokenizer=QWEN35_TOKENIZER)


def build_vision_moe_checkpoint(path: Path) -> Path:
    """The Qwen3.5 MoE vision-language layout (`Qwen3_5MoeForConditionalGeneration`, Qwen3.6-35B-A3B's): the tiny
    MoE language model (8 experts, top 2, a shared expert) with Qwen3.5's vocabulary, and the same tiny tower."""
    from hybrid_helpers import TINY_HYBRID_MOE_CONFIG

    from mili_openai.model.hybrid_checkpoint import QWEN35_TOKENIZER, build_random_hybrid_checkpoint
    from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE

    fields = TINY_HYBRID_MOE_CONFIG | dict(vocab_size=QWEN35_VOCAB_SIZE, tie_word_embeddings=True)
    return build_random_hybrid_checkpoint(path, "qwen3_5_moe_vl", fields, seed=VISION_MOE_SEED,
                                          tokenizer=QWEN35_TOKENIZER)


def build_qwen3_vl_checkpoint(path: Path) -> Path:
    from mili_openai.model.qwen3_vl_checkpoint import build_random_qwen3_vl_checkpoint

    return build_random_qwen3_vl_checkpoint(path, TINY_QWEN3_VL_TEXT, TINY_QWEN3_VL_VISION, seed=QWEN3_VL_SEED)


def build_qwen3_vl_moe_checkpoint(path: Path) -> Path:
    from mili_openai.model.qwen3_vl_checkpoint import build_random_qwen3_vl_checkpoint

    return build_random_qwen3_vl_checkpoint(path, TINY_QWEN3_VL_MOE_TEXT, TINY_QWEN3_VL_VISION, seed=QWEN3_VL_MOE_SEED)


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


# prompts as the chat templates write them (one placeholder per image), for the engine tests of both model lines
MAX_NEW = 10
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [  # (text, image indices into IMAGE_SIZES' images)
    (f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n", [0]),
    (f"<|im_start|>user\nCompare {IMAGE} and {IMAGE} please.<|im_end|>\n<|im_start|>assistant\n", [1, 2]),
    ("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
     f"<|im_start|>user\nNow look: {IMAGE}<|im_end|>\n<|im_start|>assistant\n", [2]),
]
TEXT_ONLY = "<|im_start|>user\nJust text, no picture.<|im_end|>\n<|im_start|>assistant\n"


def greedy():
    from mili_openai import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def sample_images() -> list:
    return [drawn_image(width, height, seed) for seed, (width, height) in enumerate(IMAGE_SIZES)]


def image_requests(images) -> list[dict]:
    """PROMPTS as `LLM.generate` takes them (vLLM's multi_modal_data)."""
    return [{"prompt": text, "multi_modal_data": {"image": [images[i] for i in which]}} for text, which in PROMPTS]


def transformers_greedy(model_class, checkpoint: Path, tokenizer) -> tuple[list, list, tuple[list, list]]:
    """transformers' greedy generate in fp32 for PROMPTS and TEXT_ONLY: (images, [(expanded prompt ids, tokens)]
    per prompt, (text-only ids, tokens)), on the pixel values mili's preprocessing gives."""
    import torch
    import transformers

    from mili_openai.engine.image_processor import ImagePreprocessor, expand_image_placeholders
    from mili_openai.model.vision_config import read_vision_spec

    spec = read_vision_spec(checkpoint, transformers.AutoConfig.from_pretrained(str(checkpoint)).to_dict())
    preprocess = ImagePreprocessor(spec)
    model = model_class.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    images = sample_images()
    expected = []
    for text, which in PROMPTS:
        features = [preprocess(images[i]) for i in which]
        ids = expand_image_placeholders(tokenizer.encode(text), features, spec.image_token_id)
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=MAX_NEW, do_sample=False,
                pixel_values=torch.cat([torch.from_numpy(f.pixel_values) for f in features]),
                image_grid_thw=torch.tensor([f.grid_thw for f in features]),
                mm_token_type_ids=(inputs == spec.image_token_id).int())
        expected.append((ids, out[0, len(ids):].tolist()))
    text_ids = tokenizer.encode(TEXT_ONLY)
    with torch.no_grad():
        text_out = model.generate(input_ids=torch.tensor([text_ids]), max_new_tokens=MAX_NEW, do_sample=False)
    return images, expected, (text_ids, text_out[0, len(text_ids):].tolist())
