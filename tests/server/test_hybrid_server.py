"""A Qwen3.5 checkpoint (Qwen3.5's own tokenizer and chat template) behind the real server and the openai SDK:
chat completions whole and streamed agree (greedy), a request with an image part is a 400 (a text-only
checkpoint), and /metrics shows the state
pool beside the KV pool."""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers_server import served_engine


@pytest.fixture(scope="module")
def server(hybrid_checkpoint):
    with served_engine(hybrid_checkpoint("qwen3_5_qwen35_tokenizer"), num_pages=64, page_size=8,
                       max_model_len=512, max_num_batched_tokens=64) as (live, _):
        yield live


def test_chat_whole_and_streamed_agree(server):
    client = openai.OpenAI(base_url=server.api_base, api_key="unused")
    messages = [{"role": "user", "content": "Say something about linear attention."}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen3.5's template thinks by default
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                           extra_body=no_thinking)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    pieces = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                            stream=True, extra_body=no_thinking)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    assert streamed == whole.choices[0].message.content and streamed


def test_an_image_part_is_a_400(server):
    client = openai.OpenAI(base_url=server.api_base, api_key="unused")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])


def test_metrics_show_the_state_pool(server):
    body = httpx.get(f"{server.base_url}/metrics").text
    assert "mili_state_slots" in body and "mili_state_snapshots_cached" in body
