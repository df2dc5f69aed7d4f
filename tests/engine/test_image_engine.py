"""Images through the engine (`LLM.generate` with vLLM's `multi_modal_data`) on a random Qwen3.5 vision-language
checkpoint, against transformers' `Qwen3_5ForConditionalGeneration.generate` in fp32 on the same pixel values:
greedy tokens identical with images of several sizes and aspect ratios, two images in one message, an image in a
later turn, through whole and odd-sized chunked prefills (a chunk may start or end inside an image), beside a
text-only request in the same batch, and an image repeated across requests (encoded once, never a prefix hit)."""

from __future__ import annotations

import pytest
import torch

from vision_helpers import IMAGE_SIZES, drawn_image

from mili_openai import LLM, SamplingParams
from mili_openai.engine.image_processor import ImagePreprocessor, expand_image_placeholders

MAX_NEW = 10
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [  # (text, image indices into IMAGES)
    (f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n", [0]),
    (f"<|im_start|>user\nCompare {IMAGE} and {IMAGE} please.<|im_end|>\n<|im_start|>assistant\n", [1, 2]),
    ("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
     f"<|im_start|>user\nNow look: {IMAGE}<|im_end|>\n<|im_start|>assistant\n", [2]),
]
TEXT_ONLY = "<|im_start|>user\nJust text, no picture.<|im_end|>\n<|im_start|>assistant\n"


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(vision_checkpoint, qwen35_tokenizer):
    """(images, each prompt's expanded ids and transformers' greedy tokens, the text-only prompt's), once."""
    import transformers

    from mili_openai.model.vision_config import read_vision_spec

    config = transformers.AutoConfig.from_pretrained(str(vision_checkpoint)).to_dict()
    spec = read_vision_spec(vision_checkpoint, config)
    preprocess = ImagePreprocessor(spec)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(vision_checkpoint),
                                                                          dtype=torch.float32).eval()
    images = [drawn_image(width, height, seed) for seed, (width, height) in enumerate(IMAGE_SIZES)]
    expected = []
    for text, which in PROMPTS:
        features = [preprocess(images[i]) for i in which]
        ids = expand_image_placeholders(qwen35_tokenizer.encode(text), features, spec.image_token_id)
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=MAX_NEW, do_sample=False,
                pixel_values=torch.cat([torch.from_numpy(f.pixel_values) for f in features]),
                image_grid_thw=torch.tensor([f.grid_thw for f in features]),
                mm_token_type_ids=(inputs == spec.image_token_id).int())
        expected.append((ids, out[0, len(ids):].tolist()))
    text_ids = qwen35_tokenizer.encode(TEXT_ONLY)
    with torch.no_grad():
        text_out = model.generate(input_ids=torch.tensor([text_ids]), max_new_tokens=MAX_NEW, do_sample=False)
    return images, expected, (text_ids, text_out[0, len(text_ids):].tolist())


def requests(images) -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": [images[i] for i in which]}} for text, which in PROMPTS]


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=2048),  # every prompt whole, in one batch
    dict(page_size=4, max_num_batched_tokens=37),  # odd chunks: images split across steps, beside decodes
], ids=["whole", "chunked"])
def test_greedy_matches_transformers(vision_checkpoint, oracle, engine_args):
    images, expected, (text_ids, text_tokens) = oracle
    llm = LLM(str(vision_checkpoint), dtype="float32", num_pages=256, **engine_args)
    outputs = llm.generate([*requests(images), TEXT_ONLY], greedy())
    for output, (ids, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == tokens
    assert outputs[-1].prompt_token_ids == text_ids and outputs[-1].outputs[0].token_ids == text_tokens
    llm.core.check_integrity()


def test_repeated_image_is_encoded_once_and_never_a_prefix_hit(vision_checkpoint, oracle):
    images, expected, _ = oracle
    llm = LLM(str(vision_checkpoint), dtype="float32", num_pages=256, page_size=4)
    cache = llm.core.runner.model.image_cache
    first = llm.generate(requests(images)[:1], greedy())
    encoded = cache.images_encoded
    again = llm.generate(requests(images)[:1], greedy())
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == expected[0][1]
    assert cache.images_encoded == encoded  # the second request found the image's embeddings cached
    # the same placeholder ids with a different image: the cache key is the image, not the ids
    other = [{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": [images[1]]}}]
    different = llm.generate(other, greedy())
    assert cache.images_encoded == encoded + 1
    assert llm.core.scheduler.prefix_cache_hits_total == 0
    assert different[0].outputs[0].token_ids != expected[0][1]
    llm.core.check_integrity()


def test_image_count_mismatch_is_refused(vision_checkpoint, oracle):
    images, _, _ = oracle
    llm = LLM(str(vision_checkpoint), dtype="float32", num_pages=64)
    with pytest.raises(ValueError, match="image placeholders"):
        llm.generate([{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": images[:2]}}], greedy())
