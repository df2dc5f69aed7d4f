"""/v1/chat/completions end to end: the openai SDK (sync and async) against a real uvicorn serving
the real engine on the tiny random-weight checkpoint.

Random weights write random tokens, so these tests check what holds for any output: shapes, counts,
greedy determinism (streamed == whole), seeds, stop strings cut where the text said, logprobs that
agree with greedy choice. The tool-call test forces the model's one output token with logit_bias:
the assistant prefill (continue_final_message) ends in `</tool_call`, and the forced `>` closes it.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

MODEL = "tiny-qwen3"
HELLO = [{"role": "user", "content": "Say hello."}]
FORCED_BIAS = 100
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def api_base(real_server):  # conftest's `client` is the SDK on it
    return real_server.api_base


def greedy_chat(client, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return client.chat.completions.create(model=MODEL, temperature=0, **kwargs)


def test_greedy_stream_equals_the_whole_response(client):
    whole = greedy_chat(client, max_tokens=8)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    streamed_content, streamed_reasoning, finishes, usage = "", "", [], None
    for chunk in greedy_chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed_content += c.delta.content or ""
            streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert finishes == ["length"]
    assert streamed_content == (choice.message.content or "")
    assert (streamed_reasoning or None) == choice.message.model_extra.get("reasoning_content")
    assert usage.completion_tokens == 8 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_with_a_seed_are_reproducible(client):
    def sample():
        result = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, seed=1234, temperature=1.0,
                                                max_tokens=6)
        return [(c.index, c.message.content, c.message.model_extra.get("reasoning_content")) for c in result.choices]

    first = sample()
    assert [index for index, *_ in first] == [0, 1, 2]
    assert sample() == first
    assert len({(content, reasoning) for _, content, reasoning in first}) > 1  # seed + i: samples differ


def test_logprobs_agree_with_greedy_choice(client):
    result = greedy_chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    tokens = result.choices[0].logprobs.content
    assert len(tokens) == 5
    for token in tokens:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)  # greedy took the best
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                 reverse=True)
        assert token.bytes is not None


def seeded(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=HELLO, temperature=1.0, seed=7, **kwargs)


def test_stop_string_cuts_the_content_before_it(client):
    # seeded sampling, not greedy: the tiny random model's greedy text is one token repeated
    text = seeded(client, max_tokens=12).choices[0].message.content
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1)
                 if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.fail(f"the greedy text {text!r} has no usable stop string")
    result = seeded(client, max_tokens=12, stop=[stop])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].message.content == text[: text.index(stop)]


def test_tool_call_forced_through_the_real_model(client, qwen_tokenizer):
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call'
    close = qwen_tokenizer.convert_tokens_to_ids(">")
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": prefill}]
    kwargs = dict(messages=messages, tools=[WEATHER_TOOL], max_tokens=1, logit_bias={str(close): FORCED_BIAS},
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    result = greedy_chat(client, **kwargs)
    choice = result.choices[0]
    # max_tokens ended the output (its one token completed the call): "length", the complete call kept
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = [c for chunk in greedy_chat(client, stream=True, **kwargs) for c in chunk.choices]
    calls = [t for c in streamed for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]  # the prefill wrote it all: one piece
    assert [c.finish_reason for c in streamed if c.finish_reason] == ["length"]


def test_context_overflow_is_a_400_with_the_numbers(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        greedy_chat(client, max_tokens=100_000)


def test_async_client_streams_and_answers(api_base):
    async def go():
        client = openai.AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0, timeout=60)
        whole, stream = await asyncio.gather(
            client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=4),
            client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=4, stream=True),
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(go())
    assert whole.choices[0].finish_reason == "length"
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == (
        whole.choices[0].message.content or "")
