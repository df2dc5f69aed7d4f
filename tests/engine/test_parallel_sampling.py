"""A request of n samples is one parent with n children in the engine (engine/parallel_sampling.py): the
offline `LLM` and the served engine derive the same seeds, and closing a request aborts every sample."""

from __future__ import annotations

import pytest

from engine_helpers import random_prompts, run_engine, submit_checked
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.llm import LLM
from mili_openai.engine.outputs import RequestOutput
from mili_openai.engine.parallel_sampling import ParentRequest, child_params
from mili_openai.engine.sampling_params import INT64_MAX, SamplingParams

ENGINE_ARGS = dict(dtype="float32", num_pages=64, page_size=8, max_num_batched_tokens=64, max_model_len=256)


def test_children_get_their_own_seeds_inside_int64():
    assert child_params(SamplingParams(n=3, seed=10), 2).seed == 12
    assert child_params(SamplingParams(n=3, seed=INT64_MAX), 2).seed == INT64_MAX - 2
    assert child_params(SamplingParams(n=3), 1).seed is None
    assert child_params(SamplingParams(n=3, seed=1), 1).n == 1
    assert ParentRequest.of("r", SamplingParams(n=3)).child_ids == ["r-0", "r-1", "r-2"]


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **ENGINE_ARGS))


@pytest.mark.parametrize("seed", [7, INT64_MAX])
def test_offline_and_served_samples_are_the_same(offline, engine, seed):
    """Seeded samples reproduce across both front ends, up to the top of int64 (where offline `n=2` used to
    raise on `seed + 1`)."""
    prompt = random_prompts(1, [12], seed=3)[0]
    params = SamplingParams(n=3, seed=seed, temperature=1.0, max_tokens=6, ignore_eos=True)
    [expected] = offline.generate([prompt], params)

    async def served() -> RequestOutput:
        result = RequestOutput.empty("served", prompt, params.n)
        async for delta in await submit_checked(engine, prompt, params):
            result.add(delta)
        return result

    online = run_engine(engine, served)
    assert expected.finished and online.finished
    assert [o.token_ids for o in expected.outputs] == [o.token_ids for o in online.outputs]
    assert len({tuple(o.token_ids) for o in expected.outputs}) == 3  # each sample its own seed


def test_closing_a_request_aborts_every_sample(engine):
    prompt = random_prompts(1, [12], seed=4)[0]

    async def close_early() -> None:
        stream = await submit_checked(engine, prompt, SamplingParams(n=3, max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        assert first.finish_reason is None
        await stream.aclose()  # the consumer went away
        assert not engine.core.sequences and not engine.core.requests
        engine.core.check_integrity()

    run_engine(engine, close_early)
