"""Images through the engine (`LLM.generate` with vLLM's `multi_modal_data`) on random vision-language checkpoints of
both lines, Qwen3.5 (hybrid decoder; and Qwen3.5-MoE) and Qwen3-VL (Qwen3 decoder with DeepStack; and
Qwen3-VL-MoE), against transformers' `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` /
`Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration.generate` in fp32 on the same pixel values:
greedy tokens identical with images of several sizes and aspect ratios, two images in one message, an image in a
later turn, through whole and odd-sized chunked prefills (a chunk may start or end inside an image, so DeepStack's
features are added across a chunk boundary), beside a
text-only request in the same batch, and an image repeated across requests (encoded once, and a prefix-cache hit
whose key holds the image's digest: engine/image_inputs.py)."""

from __future__ import annotations

import pytest

from vision_helpers import PROMPTS, TEXT_ONLY, greedy, image_requests, transformers_greedy

from mili_openai import LLM
from mili_openai.model.vision_batch import ImageEmbeddingCache


OTHER_QUESTIONS = ("Describe it.", "Any colours?")  # asked of PROMPTS[0]'s image instead of its question
# model line -> (checkpoint fixture, tokenizer fixture, transformers' class)
MODEL_LINES = {
    "qwen3_5": ("vision_checkpoint", "qwen35_tokenizer", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("vision_moe_checkpoint", "qwen35_tokenizer", "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl_checkpoint", "qwen_tokenizer", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("qwen3_vl_moe_checkpoint", "qwen_tokenizer", "Qwen3VLMoeForConditionalGeneration"),
}
# the prefix-cache cases run on a hybrid decoder (state snapshots) and a dense one with DeepStack; the MoE lines
# differ from theirs only in their MLPs
PREFIX_LINES = ("qwen3_5", "qwen3_vl")


@pytest.fixture(scope="module")
def vision_model(request):
    """A model line -> (checkpoint, (images, each prompt's expanded ids and transformers' greedy tokens, the
    text-only prompt's)), each line's oracle computed once, when first asked for."""
    import transformers

    computed = {}

    def oracle(line: str):
        if line not in computed:
            checkpoint_name, tokenizer_name, class_name = MODEL_LINES[line]
            checkpoint = request.getfixturevalue(checkpoint_name)
            computed[line] = checkpoint, transformers_greedy(getattr(transformers, class_name), checkpoint,
                                                             request.getfixturevalue(tokenizer_name))
        return computed[line]

    return oracle


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=2048),  # every prompt whole, in one batch
    dict(page_size=4, max_num_batched_tokens=37),  # odd chunks: images split across steps, beside decodes
], ids=["whole", "chunked"])
@pytest.mark.parametrize("line", list(MODEL_LINES))
def test_greedy_matches_transformers(vision_model, line, engine_args):
    checkpoint, (images, expected, (text_ids, text_tokens)) = vision_model(line)
    llm = LLM(str(checkpoint), dtype="float32", num_pages=256, **engine_args)
    outputs = llm.generate([*image_requests(images), TEXT_ONLY], greedy())
    for output, (ids, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == tokens
    assert outputs[-1].prompt_token_ids == text_ids and outputs[-1].outputs[0].token_ids == text_tokens
    llm.core.check_integrity()


@pytest.mark.parametrize("line", PREFIX_LINES)
def test_repeated_image_is_encoded_once_and_a_prefix_hit(vision_model, line):
    """The same image and text again: its K/V pages (and on the hybrid Qwen3.5 its state snapshot) are reused past
    the image, and the tokens are the cold run's; the same text with another image reuses nothing past the image's
    first placeholder (the ids are the same, the image's key is not)."""
    checkpoint, (images, expected, _) = vision_model(line)
    llm = LLM(str(checkpoint), dtype="float32", num_pages=256, page_size=4)
    cache = llm.core.runner.forward.model.image_cache
    ids, tokens = expected[0]
    image_start = ids.index(llm.core.info.vision.image_token_id)
    first = llm.generate(image_requests(images)[:1], greedy())
    encoded = cache.images_encoded
    again = llm.generate(image_requests(images)[:1], greedy())
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == tokens
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == (len(ids) - 1) // 4 * 4  # the last page boundary before the last token
    assert cache.images_encoded == encoded
    other = [{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": [images[1]]}}]
    different = llm.generate(other, greedy())
    assert cache.images_encoded == encoded + 1
    assert different[0].num_cached_tokens <= image_start
    assert different[0].outputs[0].token_ids != tokens
    llm.core.check_integrity()


@pytest.mark.parametrize("line", PREFIX_LINES)
def test_prefix_hit_ending_inside_an_image(vision_model, line):
    """Prompts that share PROMPTS[0]'s image and part ways right after it: the page boundary they share falls
    inside the image, so the last one resumes there (from K/V pages on Qwen3-VL, where DeepStack's additions then
    start mid-image; from the state snapshot the second one saved at the branch on the hybrid Qwen3.5), encodes
    the image again (its embeddings dropped from the encoder cache), and gives the cold run's tokens."""
    checkpoint, (images, expected, _) = vision_model(line)
    llm = LLM(str(checkpoint), dtype="float32", num_pages=256, page_size=4, max_num_seqs=1)
    ids, tokens = expected[0]
    image_start = ids.index(llm.core.info.vision.image_token_id)
    image_end = len(ids) - ids[::-1].index(llm.core.info.vision.image_token_id)
    text, _ = PROMPTS[0]
    branches = [{"prompt": text.replace("What is this?", question), "multi_modal_data": {"image": [images[0]]}}
                for question in OTHER_QUESTIONS]
    llm.generate(branches, greedy())
    model = llm.core.runner.forward.model
    model.image_cache = ImageEmbeddingCache()  # the image's embeddings gone: the chunk inside it encodes it again
    out = llm.generate(image_requests(images)[:1], greedy())
    assert image_start < out[0].num_cached_tokens < image_end
    assert out[0].outputs[0].token_ids == tokens
    assert model.image_cache.images_encoded == 1
    llm.core.check_integrity()


@pytest.mark.parametrize("line", PREFIX_LINES)
def test_image_count_mismatch_is_refused(vision_model, line):
    checkpoint, (images, _, _) = vision_model(line)
    llm = LLM(str(checkpoint), dtype="float32", num_pages=64)
    with pytest.raises(ValueError, match="image placeholders"):
        llm.generate([{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": images[:2]}}], greedy())


def test_llm_chat_places_images_where_their_parts_sit(vision_model):
    """`LLM.chat` (vLLM's offline chat) on Qwen3-VL: an image given as a PIL image (`image_pil`) or a data URL
    (`image_url`) renders through the checkpoint's template to PROMPTS[0] and gives transformers' greedy tokens."""
    import base64

    from vision_helpers import image_bytes

    checkpoint, (images, expected, _) = vision_model("qwen3_vl")
    ids, tokens = expected[0]
    url = "data:image/png;base64," + base64.b64encode(image_bytes(images[0])).decode()
    conversations = [[{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
                     for part in ({"type": "image_pil", "image_pil": images[0]},
                                  {"type": "image_url", "image_url": {"url": url}})]
    llm = LLM(str(checkpoint), dtype="float32", num_pages=64)
    outputs = llm.chat(conversations, greedy())
    assert [output.prompt_token_ids for output in outputs] == [ids, ids]
    assert [output.outputs[0].token_ids for output in outputs] == [tokens, tokens]
    with pytest.raises(ValueError, match="data URLs"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}])
