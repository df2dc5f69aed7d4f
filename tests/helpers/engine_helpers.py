"""Shared by the engine tests: an HF transformers oracle, random prompts, sequences without a model, and running an
AsyncEngine."""

from __future__ import annotations

import asyncio
import inspect
import random

import pytest
import torch

from mili_openai.config import EngineConfig, SpeculativeConfig
from mili_openai.engine.contract import check_request
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.scheduler import Scheduler
from mili_openai.engine.sequence import Sequence

LOGPROB_ATOL = 2e-4  # float32 on both sides; differences come only from summation order
GREEDY_TOP_LOGPROBS = 3  # alternatives per token that `assert_matches` holds to the oracle's rows


def make_seq(request_id: str, prompt: list[int], max_tokens: int) -> Sequence:
    """A sequence as the engine makes one, without a tokenizer: for the scheduler's and its policies' tests."""
    return Sequence(sequence_id=request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens),
                    max_tokens=max_tokens, arrival_time=0.0, detokenizer=None, stop_matcher=None, generator=None)


def speculative_scheduler(speculative: SpeculativeConfig) -> Scheduler:
    """A scheduler drafting as `speculative` says, over 32 pages of 4 tokens without prefix caching, a budget of 64
    tokens and 8 sequences: for the scheduler's and the DraftSwitch's tests."""
    config = EngineConfig(page_size=4, num_pages=32, max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_config=speculative)
    return Scheduler(config, KVPageManager(num_pages=32, page_size=4, enable_prefix_caching=False))


def greedy(max_tokens: int, **params) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored), with logprobs to compare against the
    oracle's (`hf_greedy`, `assert_matches`); `params` adds or overrides sampling fields."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                             "logprobs": GREEDY_TOP_LOGPROBS, **params})


def run_engine(engine, work):
    """`await work()` with `engine` started, then shut down (the model stays loaded for the next test)."""
    async def main():
        await engine.start()
        try:
            return await work()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def submit_checked(engine, prompt: list[int], params, request_id: str | None = None):
    """What a route does: check the request (engine/contract.py), then submit it; the request's stream."""
    return await engine.submit(check_request(prompt, params, engine.info), request_id)


def random_prompts(count: int, lengths: list[int], seed: int = 0, vocab: int = 150000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step log-softmax rows from HF transformers' Qwen3 (the oracle), on the model's
    device."""
    # transformers 5.24 renamed past_key_values to cache, in the arguments and the output (the old
    # argument warns, and goes in 5.40); earlier versions know only the old name
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens: list[int] = []
    logprob_rows: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(row.argmax())
        tokens.append(token)
        logprob_rows.append(row)
        out = model(torch.tensor([[token]], device=model.device), use_cache=True, **{cache: getattr(out, cache)})
    return tokens, logprob_rows


def load_hf(path, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def assert_matches(outputs, expected, atol: float = LOGPROB_ATOL) -> None:
    """Every completion of each output has the oracle's greedy tokens, and logprobs within `atol` of its rows."""
    for output, (tokens, rows) in zip(outputs, expected):
        for completion in output.outputs:
            assert completion.token_ids == tokens and len(completion.logprobs) == len(tokens)
            for got, row in zip(completion.logprobs, rows):
                assert got.logprob == pytest.approx(float(row[got.token_id]), abs=atol)
                for alt_id, alt_logprob in got.top:
                    assert alt_logprob == pytest.approx(float(row[alt_id]), abs=atol)


def check_abort_mid_stream_frees_pages(engine, vocab: int = 150000) -> None:
    """Requests aborted mid-stream (a closed stream, an abort) end with "abort", the rest run to their
    length, and every page is back: free or cached, none locked. Prompt ids are drawn below `vocab`."""
    prompts = random_prompts(6, [30, 45], seed=4, vocab=vocab)

    async def collect(stream):
        return [delta async for delta in stream]

    async def go():
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        streams = [await submit_checked(engine, p, params) for p in prompts]
        first = await streams[0].__anext__()
        assert first.finish_reason is None
        await streams[0].aclose()
        engine.abort(streams[1].request_id)
        return await asyncio.gather(*(collect(s) for s in streams[1:]))

    results = run_engine(engine, go)
    assert results[0][-1].finish_reason == "abort"
    assert all(r[-1].finish_reason == "length" for r in results[1:])
    engine.core.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert engine.core.pages.tree.locked_pages == 0
    assert stats.num_free_pages + stats.num_cached_pages == stats.num_pages
