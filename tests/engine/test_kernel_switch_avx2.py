"""On a CPU without AVX-512 a first start builds the AVX2 kernel set in the background, serves on torch's ops
meanwhile, and switches a bf16 model's projections to it between steps (kernels/cpu_avx2.py). The AVX-512 set is
made to look absent, so this runs on any CPU with AVX2; the build is a future the test completes itself."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
import torch.nn.functional as F
from engine_helpers import submit_checked

from mili_openai import kernels as kernels_module
from mili_openai.config import EngineConfig
from mili_openai.engine import local_forward as local_forward_module
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.kernels import cpu_avx2

pytestmark = pytest.mark.skipif(not cpu_avx2.cpu_supports_avx2_kernels(), reason="this CPU has no AVX2, FMA and F16C")

PROMPT = [9707, 11, 847, 829, 374]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SWITCH_POLLS, POLL_S = 6000, 0.01  # a bound, not a timing: the switch follows the build at once


def test_a_bf16_engine_switches_to_the_avx2_kernels_when_idle(tiny_checkpoint, monkeypatch):
    avx2 = cpu_avx2.load_avx2_kernels()  # built before the engine: the test decides when the build "ends"
    build: Future[bool] = Future()
    monkeypatch.setattr(kernels_module, "cpu_supports_kernels", lambda: False)  # as on an AVX2-only CPU
    monkeypatch.setattr(kernels_module, "cpu_kernels_built", lambda: False)
    monkeypatch.setattr(local_forward_module, "load_cpu_kernels", lambda plan_cache=True: None)
    monkeypatch.setattr(local_forward_module, "build_cpu_kernels_in_background", lambda: build)
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="bfloat16", num_pages=32,
                                      cpu_kernels_in_background=True))
    runner = engine.core.runner
    backend = runner.forward.model.backend
    assert runner.kernel_build is build and backend.matmul is F.linear  # torch's ops serve first

    async def generate() -> list[int]:
        tokens = []
        async for delta in await submit_checked(engine, PROMPT, GREEDY):
            tokens.extend(delta.token_ids)
        return tokens

    async def scenario() -> tuple[list[int], list[int]]:
        await engine.start()
        try:
            before = await generate()
            build.set_result(True)
            for _ in range(SWITCH_POLLS):
                if runner.kernel_build is None:
                    break
                await asyncio.sleep(POLL_S)
            return before, await generate()
        finally:
            await engine.shutdown()

    before, after = asyncio.run(scenario())
    assert runner.kernel_build is None, "the engine never switched"
    assert backend.matmul == avx2.linear
    assert len(before) == len(after) == GREEDY.max_tokens
