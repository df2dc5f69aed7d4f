"""The asyncio engine: streaming deltas, stop conditions, aborts, and pages returned to the pool."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import random_prompts
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=64, page_size=8,
                                    max_num_batched_tokens=64, max_model_len=256))


async def collect(stream):
    deltas = [delta async for delta in stream]
    return deltas


def run(engine, coro_fn):
    async def main():
        await engine.start()
        try:
            return await coro_fn()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_stream_ends_with_length_and_usage(engine):
    prompt = random_prompts(1, [20], seed=1)[0]

    async def go():
        return await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))

    deltas = run(engine, go)
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert sum(len(d.token_ids) for d in deltas) == 6
    assert deltas[-1].num_prompt_tokens == 20 and deltas[-1].num_output_tokens == 6
    engine.core.check_integrity()


def test_stop_token_ids_and_max_tokens_none(engine):
    prompt = random_prompts(1, [12], seed=2)[0]

    async def go():
        first = await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
        tokens = [d.token_ids[0] for d in first]
        # the first token that did not occur before it: greedy output stops exactly there
        position = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
        stopped = await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=None,
                                                                        stop_token_ids=[tokens[position]],
                                                                        ignore_eos=True)))
        return tokens[position], position, stopped

    stop_id, position, stopped = run(engine, go)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_id
    assert stopped[-1].num_output_tokens == position + 1


def test_context_length_finishes_with_length(engine):
    prompt = random_prompts(1, [250], seed=3)[0]

    async def go():
        return await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)))

    deltas = run(engine, go)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 6


def test_invalid_requests_raise_value_error(engine):
    async def go():
        with pytest.raises(ValueError, match="context length"):
            engine.submit([1] * 300, SamplingParams())
        with pytest.raises(ValueError, match="context length"):
            engine.submit([1] * 200, SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="empty"):
            engine.submit([], SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            engine.submit([10**9], SamplingParams())

    run(engine, go)


def test_abort_mid_stream_frees_pages(engine):
    prompts = random_prompts(6, [30, 45], seed=4)

    async def go():
        streams = [engine.submit(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in prompts]
        first = await streams[0].__anext__()
        assert first.finish_reason is None
        await streams[0].aclose()
        engine.abort(streams[1].request_id)
        results = await asyncio.gather(*(collect(s) for s in streams[1:]))
        return results

    results = run(engine, go)
    assert results[0][-1].finish_reason == "abort"
    assert all(r[-1].finish_reason == "length" for r in results[1:])
    engine.core.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert engine.core.pages.tree.locked_pages == 0
    assert stats.num_free_pages + stats.num_cached_pages == stats.num_pages


def test_stop_string_is_never_emitted(engine):
    prompt = random_prompts(1, [15], seed=6)[0]

    async def go():
        full = await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        text = "".join(d.text for d in full)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = await collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                    stop=[stop])))
        return text, stop, cut

    text, stop, cut = run(engine, go)
    got = "".join(d.text for d in cut)
    assert cut[-1].finish_reason == "stop" and cut[-1].stop_reason == stop
    assert got == text[: text.index(stop)]
