"""Steps launched on the engine loop and finished on the worker (`EngineConfig.async_launch`, CUDA's default),
run here on CPU: the step planned ahead reads its pending input ids from the running step's sampled ids on
the device (`PendingTokens.feed`), and its outputs match the offline engine's and transformers'."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_helpers import (
    check_abort_mid_stream_frees_pages,
    hf_greedy,
    load_hf,
    random_prompts,
    run_engine,
    submit_checked,
)
from mili_openai import LLM
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.sampling_params import SamplingParams

ENGINE_SHAPE = dict(dtype="float32", num_pages=64, page_size=8, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), async_launch=True, **ENGINE_SHAPE))


@pytest.fixture
def launches(engine):
    """Per step launched: (launched on the loop thread, fed on the ids of the step before)."""
    runner = engine.core.runner
    launch, recorded = runner.launch, []
    loop_thread = threading.current_thread()  # run_engine runs the loop on the test's thread

    def recording_launch(step):
        launched = launch(step)
        recorded.append((threading.current_thread() is loop_thread, launched.source is not None))
        return launched

    runner.launch = recording_launch
    yield recorded
    del runner.launch


async def collect(stream):
    return [delta async for delta in stream]


def generate(engine, prompts, params):
    async def go():
        streams = [await submit_checked(engine, p, sp) for p, sp in zip(prompts, params)]
        return await asyncio.gather(*(collect(s) for s in streams))

    return run_engine(engine, go)


def tokens_of(results):
    return [[t for d in deltas for t in d.token_ids] for deltas in results]


def test_greedy_tokens_match_transformers(engine, tiny_checkpoint, launches):
    prompts = random_prompts(4, [9, 23, 14], seed=21)
    model = load_hf(tiny_checkpoint)
    want = [hf_greedy(model, p, 12)[0] for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    assert tokens_of(generate(engine, prompts, params)) == want
    assert all(on_loop for on_loop, _ in launches)  # every step launched on the loop thread
    assert sum(fed for _, fed in launches) >= 8  # decodes fed on the device, planned a step ahead
    engine.core.check_integrity()


def test_outputs_match_the_offline_engines(engine, tiny_checkpoint, launches):
    """Greedy, seeded and logprobs rows launched ahead; then rows whose sampling reads their output so far
    (penalties, min_tokens), which wait for the step before on the worker; all as the offline engine."""
    offline = LLM(str(tiny_checkpoint), **ENGINE_SHAPE)
    prompts = random_prompts(8, [9, 30, 17], seed=7)
    eos = engine.info.eos_token_ids[0]
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, top_p=0.8, top_k=20, max_tokens=9, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, presence_penalty=1.5, frequency_penalty=1.0,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    ]
    want = offline.generate(prompts, params)
    got = generate(engine, prompts[:4], params[:4])
    assert sum(fed for _, fed in launches) >= 8
    launches.clear()
    got += generate(engine, prompts[4:], params[4:])
    assert tokens_of(got) == [out.outputs[0].token_ids for out in want]
    for deltas, out in ((got[0], want[0]), (got[2], want[2])):  # the rows asking for logprobs
        logprobs = [entry for d in deltas for entry in d.logprobs]
        for entry, expected in zip(logprobs, out.outputs[0].logprobs, strict=True):
            assert entry.token_id == expected.token_id and entry.logprob == pytest.approx(expected.logprob)
            assert [t for t, _ in entry.top] == [t for t, _ in expected.top]
            assert [v for _, v in entry.top] == pytest.approx([v for _, v in expected.top])
    # steps with rows reading their history launch on the worker once the step before has finished
    assert any(not on_loop for on_loop, _ in launches)
    engine.core.check_integrity()


def test_abort_mid_flight_frees_pages(engine):
    check_abort_mid_stream_frees_pages(engine)


@pytest.mark.parametrize("stage", ["launch", "finish"])
def test_a_failed_step_fails_only_its_requests(engine, stage):
    """A step that fails (queuing it, or reading its results) fails its requests and the step fed on its
    tokens; a request arriving after is served."""
    sampler = engine.core.runner.sampler
    real = getattr(sampler, stage)
    calls = {"count": 0}

    def failing(*args):
        calls["count"] += 1
        if calls["count"] == 3:  # a decode step, with the step after it planned on its tokens
            raise RuntimeError("injected failure")
        return real(*args)

    prompts = random_prompts(3, [12, 20], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def go():
        failed = await asyncio.gather(*[collect(await submit_checked(engine, p, greedy)) for p in prompts[:2]])
        later = await collect(await submit_checked(engine, prompts[2], greedy))
        return failed, later

    setattr(sampler, stage, failing)
    try:
        failed, later = run_engine(engine, go)
    finally:
        delattr(sampler, stage)
    for deltas in failed:
        assert deltas[-1].finish_reason == "abort" and "injected failure" in deltas[-1].error
    assert later[-1].finish_reason == "length" and later[-1].error is None
    assert len([t for d in later for t in d.token_ids]) == 10
    engine.core.check_integrity()
    assert engine.stats().num_running == 0


def test_structured_outputs_match_the_offline_engines(engine, tiny_checkpoint, launches):
    """A format's matcher advances when its step finishes: the step planned after it launches once that
    one has finished, and the output follows the format as the offline engine's does."""
    from mili_openai.engine.sampling_params import StructuredOutputsParams

    offline = LLM(str(tiny_checkpoint), **ENGINE_SHAPE)
    prompts = random_prompts(3, [11, 19], seed=13)
    params = [SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[ab]{3,20}")),
              SamplingParams(temperature=0.7, seed=2, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    want = offline.generate(prompts, params)
    got = generate(engine, prompts, params)
    assert tokens_of(got) == [out.outputs[0].token_ids for out in want]
    assert "".join(d.text for d in got[1]) in {"yes", "no", "maybe"}
    assert any(not on_loop for on_loop, _ in launches)
    engine.core.check_integrity()
