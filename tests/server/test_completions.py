"""/v1/completions wire shapes against a scripted engine: choices, n, echo, logprobs, streaming, usage."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from helpers_server import SETTLE_POLL_S, SETTLE_TIMEOUT_S, TEST_MODEL_NAME, FakeEngine, asgi_client, sse_data

pytestmark = pytest.mark.anyio

COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason"}


async def complete(engine, **body):
    async with asgi_client(engine) as client:
        response = await client.post("/v1/completions", json={"model": TEST_MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_response_shape_and_usage(fake_engine):
    body = await complete(fake_engine, prompt="Hello there", max_tokens=5, temperature=0)
    assert set(body) == COMPLETION_KEYS
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == TEST_MODEL_NAME
    [choice] = body["choices"]
    assert set(choice) == CHOICE_KEYS
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_ids = fake_engine.info.tokenizer.encode("Hello there")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5, "prompt_tokens_details": {"cached_tokens": 0}}
    submitted_prompt, params, request_id = fake_engine.submitted[0]
    assert submitted_prompt == prompt_ids and params.max_tokens == 5 and params.greedy
    assert request_id == body["id"]  # one engine request; its samples are its own (engine/parallel_sampling.py)


async def test_default_max_tokens_is_16(fake_engine):
    body = await complete(fake_engine, prompt="Hi")
    assert body["usage"]["completion_tokens"] == 16
    assert fake_engine.submitted[0][1].max_tokens == 16


async def test_prompts_times_n_choice_indices(fake_engine):
    body = await complete(fake_engine, prompt=[[5, 6], [1, 2, 3]], n=3, max_tokens=2, seed=7)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    # one engine request per prompt, n samples each; prompt p's sample i is choice p*n + i
    assert [s[0] for s in fake_engine.submitted] == [[5, 6], [1, 2, 3]]
    assert all(s[1].n == 3 and s[1].seed == 7 for s in fake_engine.submitted)
    usage = body["usage"]
    assert usage["prompt_tokens"] == 2 + 3  # each prompt counted once, not once per sample
    assert usage["completion_tokens"] == 12


async def test_list_of_strings_prompt(fake_engine):
    body = await complete(fake_engine, prompt=["one", "two three"], max_tokens=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [s[0] for s in fake_engine.submitted] == [fake_engine.info.tokenizer.encode(p) for p in ("one", "two three")]


async def test_seed_reproducible_and_samples_differ(fake_engine):
    first = await complete(fake_engine, prompt="seeded", n=2, max_tokens=8, seed=123, temperature=1.0)
    second = await complete(fake_engine, prompt="seeded", n=2, max_tokens=8, seed=123, temperature=1.0)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in second["choices"]]
    assert texts[0] != texts[1]


async def test_echo_and_logprobs_shape(fake_engine):
    body = await complete(fake_engine, prompt="Echo me", max_tokens=3, logprobs=2, echo=True, temperature=0)
    choice = body["choices"][0]
    assert choice["text"].startswith("Echo me")
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    num_prompt = len(fake_engine.info.tokenizer.encode("Echo me"))
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][:num_prompt] == [None] * num_prompt  # prompt tokens are not scored
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][num_prompt:])
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][num_prompt:])  # chosen + top-2
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert all(offsets[i + 1] == offsets[i] + len(logprobs["tokens"][i]) for i in range(len(offsets) - 1))


async def test_stop_string_and_engine_fields(fake_engine):
    greedy = await complete(fake_engine, prompt="x", max_tokens=12, temperature=0)
    text = greedy["choices"][0]["text"]
    stop = text.split()[3]
    stopped = await complete(fake_engine, prompt="x", max_tokens=12, temperature=0, stop=[stop], top_k=5,
                             min_p=0.1, repetition_penalty=1.1, ignore_eos=True, min_tokens=1, logit_bias={"5": 2})
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]
    params = fake_engine.submitted[-1][1]
    assert (params.top_k, params.min_p, params.repetition_penalty, params.ignore_eos, params.min_tokens) == (
        5, 0.1, 1.1, True, 1)
    assert params.logit_bias == {5: 2.0}


async def test_stream_wire_format(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/completions", json={
            "prompt": "stream me", "n": 2, "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "logprobs": 1,
        })
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    *choice_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finishes = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in choice_chunks:
        [choice] = chunk["choices"]
        assert chunk["usage"] is None
        texts[choice["index"]] += choice["text"]
        assert set(choice["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert finishes == {0: ["length"], 1: ["length"]}  # exactly one finish_reason per choice
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    plain = await complete(fake_engine, prompt="stream me", n=2, max_tokens=4, temperature=0)
    assert [texts[0], texts[1]] == [c["text"] for c in plain["choices"]]


async def test_return_token_ids_whole_and_streamed(fake_engine):
    """vLLM's return_token_ids: each choice carries its prompt's ids and the generated ids; streamed, the prompt's
    come on each choice's first chunk only and the chunks' ids join into the whole response's."""
    body = await complete(fake_engine, prompt=[[5, 6], [1, 2, 3]], n=2, max_tokens=3, temperature=0,
                          return_token_ids=True)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[5, 6], [5, 6], [1, 2, 3], [1, 2, 3]]
    assert all(len(c["token_ids"]) == 3 for c in body["choices"])
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/completions", json={
            "prompt": [[5, 6], [1, 2, 3]], "n": 2, "max_tokens": 3, "temperature": 0, "stream": True,
            "return_token_ids": True})
    chunks = [orjson.loads(e) for e in sse_data(response.text)[:-1]]
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list[list[int]]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
        if "prompt_token_ids" in choice:
            prompts.setdefault(choice["index"], []).append(choice["prompt_token_ids"])
    assert [streamed[i] for i in range(4)] == [c["token_ids"] for c in body["choices"]]
    assert prompts == {0: [[5, 6]], 1: [[5, 6]], 2: [[1, 2, 3]], 3: [[1, 2, 3]]}
    plain = await complete(fake_engine, prompt="Hi", max_tokens=2)
    assert set(plain["choices"][0]) == CHOICE_KEYS  # only when asked


async def test_stream_without_usage_has_no_usage_key(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
    chunks = [orjson.loads(e) for e in sse_data(response.text)[:-1]]
    assert chunks and all("usage" not in c and len(c["choices"]) == 1 for c in chunks)


async def test_stream_echo_comes_first(fake_engine):
    async with asgi_client(fake_engine) as client:
        response = await client.post("/v1/completions", json={"prompt": "Echo", "max_tokens": 2, "stream": True,
                                                               "echo": True})
    first = orjson.loads(sse_data(response.text)[0])
    assert first["choices"][0]["text"].startswith("Echo")


async def settles(predicate, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Until `predicate` holds (True), or `timeout_s` passed (False): a wait on state, not a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(SETTLE_POLL_S)
    return True


async def test_abandoned_non_streaming_request_is_aborted(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.05)
    async with asgi_client(engine) as client:
        task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 200}))
        assert await settles(lambda: bool(engine.tasks))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await settles(lambda: not engine.tasks)
    assert not engine.tasks and not engine.owned


async def test_request_timeout_aborts(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, token_delay_s=0.02)
    async with asgi_client(engine, request_timeout_s=0.2) as client:
        response = await client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 200})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert response.json()["usage"]["completion_tokens"] < 200  # what was generated before the timeout
    assert not engine.tasks
