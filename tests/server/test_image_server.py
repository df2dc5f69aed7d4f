"""Images through the real server and the openai SDK, on a tiny random Qwen3.5 vision-language checkpoint: a chat
with a data-URL image and the Responses API with `input_image` run the image (the prompt counts its merged
patches; the same image gives the same greedy answer, another image another); fuzzed image inputs (corrupt or
truncated bytes, a non-image MIME type, too many pixels, too many images, a URL off the allow-list, an image to
a text-only model) are OpenAI-shaped 400s and leave the server healthy. LangChain's `ChatOpenAI` sends an image
message as the SDK does."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from helpers_server import asgi_client, live_server, sdk_client

from vision_helpers import image_bytes, drawn_image

from mili_openai.config import EngineConfig, MediaConfig, ServerConfig
from mili_openai.engine.image_processor import ImagePreprocessor
from mili_openai.model.vision_config import read_vision_spec

MAX_PIXELS = 400 * 400
MAX_IMAGES = 2
QUESTION = "What is in the picture?"


def data_url(image, fmt: str = "PNG", mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(image_bytes(image, fmt)).decode()}"


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def server(vision_checkpoint):
    from mili_openai.engine.async_engine import AsyncEngine
    from mili_openai.server.app import create_app

    engine = AsyncEngine(EngineConfig(model=str(vision_checkpoint), dtype="float32", num_pages=128, page_size=16,
                                      max_num_batched_tokens=128, max_num_seqs=8, max_model_len=1024))
    media = MediaConfig(max_image_pixels=MAX_PIXELS, max_images_per_request=MAX_IMAGES)
    app = create_app(ServerConfig(served_model_name="tiny", request_timeout_s=60.0, media=media), engine=engine)
    with live_server(app) as live:
        yield live


def greedy_chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **kwargs)


def said(completion) -> str:
    """All the text of a chat answer: a Qwen3.5 template opens thinking, so it starts in reasoning_content."""
    message = completion.choices[0].message
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


def test_chat_with_a_data_url_image_runs_the_image(server, vision_checkpoint, qwen35_tokenizer):
    client = sdk_client(server.api_base)
    image, other = drawn_image(300, 120, 1), drawn_image(90, 260, 2)
    first = greedy_chat(client, image_message(data_url(image)))
    spec = read_vision_spec(vision_checkpoint, json.loads((vision_checkpoint / "config.json").read_text()))
    text_ids = qwen35_tokenizer.encode(qwen35_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True))
    assert first.usage.prompt_tokens == len(text_ids) - 1 + ImagePreprocessor(spec)(image).num_tokens
    assert first.usage.completion_tokens == 8
    again = greedy_chat(client, image_message(data_url(image, "JPEG", "image/jpeg")))  # same size, so same count
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    repeat = greedy_chat(client, image_message(data_url(image)))
    assert said(repeat) == said(first) and said(first)
    different = greedy_chat(client, image_message(data_url(other)))
    assert said(different) != said(first)


def test_two_images_and_an_image_in_a_later_turn(server):
    client = sdk_client(server.api_base)
    urls = [data_url(drawn_image(64, 48, 0)), data_url(drawn_image(300, 120, 1))]
    both = greedy_chat(client, image_message(*urls))
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}, *image_message(urls[1])]
    later = greedy_chat(client, history)
    assert both.usage.completion_tokens == later.usage.completion_tokens == 8


def test_responses_with_input_image(server):
    client = sdk_client(server.api_base)
    url = data_url(drawn_image(300, 120, 1))
    response = client.responses.create(model="tiny", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "high"},
                                     {"type": "input_text", "text": QUESTION}]}])
    chat = greedy_chat(sdk_client(server.api_base), image_message(url))
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning" for part in item.content or [])
    assert reasoning + response.output_text == said(chat)


def test_langchain_chat_openai_with_an_image_message(server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    url = data_url(drawn_image(300, 120, 1))
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # the answer in `content`, which LangChain reads
    chat_model = ChatOpenAI(base_url=server.api_base, api_key="unused", model="tiny", temperature=0, max_tokens=8,
                            max_retries=0, timeout=60, extra_body=no_thinking)
    message = chat_model.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": QUESTION}])])
    expected = greedy_chat(sdk_client(server.api_base), image_message(url), extra_body=no_thinking)
    assert message.content == expected.choices[0].message.content and message.content


def truncated_png() -> str:
    payload = image_bytes(drawn_image(120, 120, 3))
    return "data:image/png;base64," + base64.b64encode(payload[: len(payload) // 2]).decode()


BAD_IMAGES = {
    "corrupt bytes": ["data:image/png;base64," + base64.b64encode(b"\x89PNG not really an image").decode()],
    "truncated": [truncated_png()],
    "not base64": ["data:image/png;base64,@@@@"],
    "wrong MIME type": ["data:text/plain;base64," + base64.b64encode(b"hello").decode()],
    "too many pixels": [data_url(drawn_image(500, 401, 4))],
    "too many images": [data_url(drawn_image(64, 48, 0))] * (MAX_IMAGES + 1),
    "URL not allowed": ["https://example.com/cat.png"],
    "unknown scheme": ["file:///etc/passwd"],
}


@pytest.mark.parametrize("urls", BAD_IMAGES.values(), ids=BAD_IMAGES.keys())
def test_bad_images_are_400s_and_the_server_stays_healthy(server, urls):
    client = sdk_client(server.api_base)
    with pytest.raises(openai.BadRequestError) as caught:
        greedy_chat(client, image_message(*urls))
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"].startswith("messages")
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert greedy_chat(client, [{"role": "user", "content": "still there?"}]).usage.completion_tokens == 8


def test_unknown_content_part_is_a_400(server):
    response = httpx.post(f"{server.api_base}/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert response.status_code == 400 and "input_audio" in response.json()["error"]["message"]


@pytest.mark.anyio
async def test_an_image_to_a_text_only_model_is_a_400(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": "test-model", "messages": image_message(data_url(drawn_image(64, 48, 0)))})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "images_not_supported"


@pytest.mark.anyio
async def test_qwen3_vl_chat_route_matches_transformers(qwen3_vl_checkpoint, qwen_tokenizer):
    """Qwen3-VL through /v1/chat/completions: its checkpoint's template (Qwen3-VL's shape) places the image where its
    part sits, and the greedy answer is transformers' `Qwen3VLForConditionalGeneration` fp32 one for that prompt."""
    import transformers
    from vision_helpers import MAX_NEW, PROMPTS, transformers_greedy

    from mili_openai.engine.async_engine import AsyncEngine

    images, expected, _ = transformers_greedy(transformers.Qwen3VLForConditionalGeneration, qwen3_vl_checkpoint,
                                              qwen_tokenizer)
    (ids, tokens), (_, which) = expected[0], PROMPTS[0]
    engine = AsyncEngine(EngineConfig(model=str(qwen3_vl_checkpoint), dtype="float32", num_pages=64, page_size=16,
                                      max_num_seqs=4, max_model_len=512))
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[which[0]])}},
                                            {"type": "text", "text": "What is this?"}]}]
    async with asgi_client(engine) as client:
        response = await client.post("/v1/chat/completions", timeout=120, json={
            "model": "test-model", "messages": message, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == qwen_tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.anyio
async def test_low_detail_images_are_resized_within_a_smaller_budget(vision_checkpoint):
    """`detail: "low"` resizes an image past LOW_DETAIL_PIXELS down to it (fewer tokens); a smaller image is
    unchanged (the same embeddings, so the same digest); "high" keeps the checkpoint's bounds."""
    from mili_openai.engine.image_processor import LOW_DETAIL_PIXELS
    from mili_openai.protocol.chat import ImageURL
    from mili_openai.protocol.image_loading import load_images

    preprocess = ImagePreprocessor(read_vision_spec(vision_checkpoint,
                                                    json.loads((vision_checkpoint / "config.json").read_text())))
    big, small = data_url(drawn_image(1200, 900, 5)), data_url(drawn_image(300, 120, 1))
    refs = [(ImageURL(url=url, detail=detail), "messages[0].content") for url in (big, small) for detail in ("high", "low")]
    high_big, low_big, high_small, low_small = await load_images(refs, MediaConfig(), preprocess)
    _, rows, columns = low_big.grid_thw
    assert rows * columns * preprocess.spec.preprocessor["patch_size"] ** 2 <= LOW_DETAIL_PIXELS
    assert low_big.num_tokens < high_big.num_tokens
    assert low_small.digest == high_small.digest and low_big.digest != high_big.digest
