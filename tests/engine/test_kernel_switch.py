"""A first start serves on torch's ops while the CPU kernels compile on a thread, then switches to them on the
forward thread, between steps, once no request runs (EngineConfig.cpu_kernels_in_background).

The build is a future the test completes itself: no test waits on a compile or on time."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
import torch
from engine_helpers import submit_checked
from quant_helpers import SERVED_SHAPE

from mili_openai.config import EngineConfig
from mili_openai import kernels as kernels_module
from mili_openai.engine import local_forward as local_forward_module
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels
from mili_openai.model import build_random_checkpoint
from mili_openai.model.quantization.modules import QuantizedLinear

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="the CPU kernels need AVX512")

PROMPT = [9707, 11, 847, 829, 374]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def pending_build(monkeypatch):
    """Kernels that look unbuilt to the runner, and a build the test finishes by hand."""
    load_cpu_kernels()  # compiled (if need be) before the engine: the test then controls when they "finish"
    build: Future[bool] = Future()
    monkeypatch.setattr(kernels_module, "cpu_kernels_built", lambda: False)
    monkeypatch.setattr(local_forward_module, "build_cpu_kernels_in_background", lambda: build)
    return build


async def generate(engine: AsyncEngine, params: SamplingParams = GREEDY) -> list[int]:
    tokens = []
    async for delta in await submit_checked(engine, PROMPT, params):
        tokens.extend(delta.token_ids)
    return tokens


SWITCH_POLLS, POLL_S = 6000, 0.01  # a bound, not a timing: the switch follows the build at once


async def wait_for_switch(engine: AsyncEngine) -> None:
    """Until the loop has switched (it does so as soon as it is idle)."""
    for _ in range(SWITCH_POLLS):
        if engine.core.runner.kernel_build is None:
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError("the engine never switched to the kernels")


def test_serves_on_torch_ops_then_switches_when_idle(tiny_checkpoint, pending_build):
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=32,
                                      cpu_kernels_in_background=True))
    runner = engine.core.runner
    assert runner.sampler.kernel is None and runner.kernel_build is pending_build
    switched_with_sequences = []
    switch = runner.switch_to_cpu_kernels

    def recorded_switch() -> None:
        switched_with_sequences.append(len(engine.core.sequences))
        switch()

    runner.switch_to_cpu_kernels = recorded_switch

    async def scenario() -> tuple[list[int], list[int]]:
        await engine.start()
        try:
            first = asyncio.create_task(generate(engine))
            await asyncio.sleep(0)
            pending_build.set_result(True)  # the build ends while the request may still run
            before = await first
            await wait_for_switch(engine)
            return before, await generate(engine)
        finally:
            await engine.shutdown()

    before, after = asyncio.run(scenario())
    assert switched_with_sequences == [0]  # never under a running request
    assert runner.sampler.kernel is load_cpu_kernels()
    assert before == after  # greedy output is the same on either path (float32)


def test_a_failed_build_keeps_torch_ops(tiny_checkpoint, pending_build):
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=32,
                                      cpu_kernels_in_background=True))

    async def scenario() -> list[int]:
        await engine.start()
        try:
            pending_build.set_exception(RuntimeError("no compiler"))
            await wait_for_switch(engine)
            return await generate(engine)
        finally:
            await engine.shutdown()

    assert len(asyncio.run(scenario())) == GREEDY.max_tokens
    assert engine.core.runner.sampler.kernel is None


def test_off_by_default_the_load_waits_for_the_kernels(tiny_checkpoint):
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=32))
    assert engine.core.runner.kernel_build is None and engine.core.runner.sampler.kernel is load_cpu_kernels()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_wait_for_the_kernels(tmp_path, pending_build, quantization):
    """On torch's ops int8/int4 weights are dequantized in float32 at every call (`reference_linear`): a
    quantized server builds the kernels before it serves, and every projection, the LM head and the decode
    stack run compiled from the first step (prefill chunks, mixed steps and decode alike)."""
    checkpoint = build_random_checkpoint(tmp_path / "dense", SERVED_SHAPE, seed=5, dtype=torch.bfloat16)
    engine = AsyncEngine(EngineConfig(model=str(checkpoint), dtype="bfloat16", num_pages=32,
                                      quantization=quantization, cpu_kernels_in_background=True))
    runner, kernels = engine.core.runner, load_cpu_kernels()
    assert runner.kernel_build is None and runner.sampler.kernel is kernels
    projections = [m for m in runner.forward.model.modules() if isinstance(m, QuantizedLinear)]
    assert runner.forward.model.lm_head in projections
    assert all(m.backend is runner.forward.model.backend for m in projections)
    assert runner.forward.model.backend.quantized_matmul == kernels.quantized.linear
    if kernels.bf16_dot_products:  # the int8/int4 kernels need AVX512-BF16 (elsewhere the reference runs)
        assert runner.forward.model.model.decode_stack is not None


def test_a_draft_model_awaits_the_kernels_and_switches_with_the_target(tiny_checkpoint, pending_build):
    """The draft model (speculative decoding) has a backend of its own: it serves on torch's ops beside the
    target's until the build ends, then both take the compiled kernels in the one switch."""
    draft = {"model": str(tiny_checkpoint), "num_speculative_tokens": 2}
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=32,
                                      cpu_kernels_in_background=True, speculative_config=draft))
    runner = engine.core.runner
    backends = (runner.forward.model.backend, runner.forward.draft.model.backend)
    assert backends[0] is not backends[1]
    assert all(backend.awaits_cpu_kernels and backend.attention is None for backend in backends)
    pending_build.set_result(True)
    runner.switch_to_cpu_kernels()
    assert all(not backend.awaits_cpu_kernels and backend.attention is load_cpu_kernels() for backend in backends)
