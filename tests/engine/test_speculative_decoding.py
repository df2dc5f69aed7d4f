"""Speculative decoding with n-gram drafts: the prompt-lookup proposer against a brute-force search, and
the engine with drafts against HF transformers and against itself without drafts. Greedy tokens must be
identical and logprobs close through batching, chunked prefill, penalties, min_tokens, stop tokens and
a prefix cached from pages a drafting decode wrote; random rows must keep plain decoding's distribution.
Prompts repeat short patterns, so that the tiny random model's continuations recur and drafts are both
accepted and rejected (each test checks that both happened)."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import assert_matches, greedy, hf_greedy, load_hf, random_prompts, submit_checked
from helpers_server import served_engine
from mili_openai import LLM, SamplingParams
from mili_openai.config import EngineConfig, ServerConfig, SpeculativeConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.proposers import propose_ngram_draft
from mili_openai.server.app import load_engine
from mili_openai.server.state import ServerState

# drafts at every batch size (the tests batch more requests than the CPU's default allows)
SPECULATIVE = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
               "disable_by_batch_size": None}
MAX_NEW = 24


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(1000, 60000) for _ in range(rng.randrange(2, 7))]
        prompts.append([rng.randrange(1000, 60000) for _ in range(rng.randrange(0, 20))] + pattern * 5)
    return prompts


def assert_drafts_kept_and_rejected(llm: LLM) -> None:
    stats = llm.core.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    llm.core.check_integrity()
    assert llm.core.pages.tree.locked_pages == 0


@pytest.fixture(scope="module")
def prompts():
    return looping_prompts(6, seed=3)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint, prompts):
    model = load_hf(tiny_checkpoint)
    return [hf_greedy(model, prompt, MAX_NEW) for prompt in prompts]


@pytest.fixture(scope="module")
def plain_llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=8)


# ---- the proposer ----------------------------------------------------------------------------------------

def brute_force_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
        for start in range(len(tokens) - n):  # followed by at least one token
            if suffix is not None and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposer_examples():
    assert propose_ngram_draft([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert propose_ngram_draft([1, 2, 3, 4], 1, 3, 4) == []  # nothing recurs
    # the longest n-gram wins over an earlier shorter one: [8, 9] recurs after [5], [7, 8, 9] after [6]
    assert propose_ngram_draft([8, 9, 5, 7, 8, 9, 6, 7, 8, 9], 1, 3, 1) == [6]
    assert propose_ngram_draft([3, 1, 3, 2, 3], 1, 1, 2) == [1, 3]  # the earliest occurrence
    assert propose_ngram_draft([3, 1, 3], 1, 1, 0) == []
    assert propose_ngram_draft([3], 1, 2, 4) == []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(0, 6))
def test_proposer_matches_a_brute_force_search(tokens, min_n, extra, k):
    assert propose_ngram_draft(tokens, min_n, min_n + extra, k) == brute_force_draft(tokens, min_n, min_n + extra, k)


def test_speculative_config_defaults_and_checks():
    assert SpeculativeConfig(2).prompt_lookup_min == SpeculativeConfig(2).prompt_lookup_max == 5  # vLLM's
    only_max = SpeculativeConfig(2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == SpeculativeConfig(2)
    for bad in [dict(num_speculative_tokens=0), dict(num_speculative_tokens=True), dict(num_speculative_tokens=2,
                prompt_lookup_min=3, prompt_lookup_max=2), dict(num_speculative_tokens=2, method="medusa"),
                dict(num_speculative_tokens=2, disable_by_batch_size=0)]:
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config=[4])


# ---- the engine ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "engine_args",
    [
        dict(page_size=8, max_num_batched_tokens=4096),  # every sequence decodes in one batch
        dict(page_size=4, max_num_batched_tokens=20),  # chunked prefill beside drafting decodes, drafts cut
        dict(page_size=8, max_num_batched_tokens=4096, enable_prefix_caching=False),
        dict(page_size=4, max_num_batched_tokens=4096, num_pages=36),  # preempted and recomputed
    ],
    ids=["batched", "chunked", "no-prefix-cache", "preemption"],
)
def test_greedy_with_drafts_matches_transformers(tiny_checkpoint, prompts, oracle, engine_args):
    engine_args = {"num_pages": 256, **engine_args}
    llm = LLM(str(tiny_checkpoint), dtype="float32", speculative_config=SPECULATIVE, **engine_args)
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), oracle)
    assert_drafts_kept_and_rejected(llm)
    assert (llm.core.stats().num_preemptions_total > 0) == (engine_args["num_pages"] < 64)


def test_penalties_min_tokens_and_stops_see_the_drafts(tiny_checkpoint, prompts, plain_llm):
    """Draft rows sample as if the drafts before them were kept: penalties count them, min_tokens counts
    them, and a stop token inside a run of kept drafts ends the sequence there."""
    plain_tokens = plain_llm.generate(prompts[:1], greedy(MAX_NEW))[0].outputs[0].token_ids
    stop_token = plain_tokens[4]  # where the plain run would stop
    cases = [
        greedy(MAX_NEW, repetition_penalty=1.3),
        greedy(MAX_NEW, presence_penalty=0.7, frequency_penalty=0.4),
        greedy(MAX_NEW, stop_token_ids=[stop_token]),
        greedy(MAX_NEW, stop_token_ids=[stop_token], min_tokens=plain_tokens.index(stop_token) + 3),
        greedy(max_tokens=7),
    ]
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=8, speculative_config=SPECULATIVE)
    for params in cases:
        expected = plain_llm.generate(prompts, params)
        got = llm.generate(prompts, params)
        for want, have in zip(expected, got):
            want, have = want.outputs[0], have.outputs[0]
            assert (have.token_ids, have.finish_reason, have.stop_reason) == (
                want.token_ids, want.finish_reason, want.stop_reason), params
            assert [e.token_id for e in have.logprobs] == have.token_ids
            for a, b in zip(have.logprobs, want.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=2e-4)
    assert_drafts_kept_and_rejected(llm)


def test_a_prefix_cached_from_drafting_decodes_holds_only_kept_tokens(tiny_checkpoint, prompts):
    """Pages a drafting decode wrote go to the prefix cache when it finishes: a second request that
    extends the first one's output reads them, and must see the kept tokens' K/V, never a rejected draft's."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=4, speculative_config=SPECULATIVE)
    first = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy(MAX_NEW))]
    extended = [prompt + output[:18] for prompt, output in zip(prompts, first)]
    hits_before = llm.core.stats().prefix_cache_hits_total
    model = load_hf(tiny_checkpoint)
    assert_matches(llm.generate(extended, greedy(12)), [hf_greedy(model, p, 12) for p in extended])
    assert llm.core.stats().prefix_cache_hits_total - hits_before >= sum(len(p) for p in extended) // 2
    assert_drafts_kept_and_rejected(llm)


def test_random_rows_keep_the_distribution_of_plain_decoding(tiny_checkpoint, plain_llm):
    """Two tokens carry all the probability (a logit bias), 3:1; sequences of them recur, so most steps
    draft. The rate of each token and of repeats must match plain decoding's, and a seed reproduces."""
    common, likely = 1234, 4321
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, n=48, seed=7,
                            logit_bias={common: 40.0, likely: 41.0986})  # e ** 1.0986 = 3
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=512, page_size=8, speculative_config=SPECULATIVE)
    prompt = [common, likely] * 4

    def rates(output):
        samples = [c.token_ids for c in output.outputs]
        tokens = [t for s in samples for t in s]
        assert set(tokens) <= {common, likely}
        repeats = [a == b for s in samples for a, b in zip(s, s[1:])]
        return tokens.count(likely) / len(tokens), sum(repeats) / len(repeats)

    drafted = llm.generate([prompt], params)[0]
    plain = plain_llm.generate([prompt], params)[0]
    for got, want in zip(rates(drafted), rates(plain)):
        assert got == pytest.approx(want, abs=0.06)  # ~4 standard errors over 48 x 24 tokens each
    assert [c.token_ids for c in llm.generate([prompt], params)[0].outputs] == [c.token_ids for c in drafted.outputs]
    assert_drafts_kept_and_rejected(llm)


def test_drafts_through_a_real_server(tiny_checkpoint, prompts, plain_llm):
    """The openai SDK against a live server that drafts: a streamed completion has plain decoding's text,
    a logprob per token and the right usage; /metrics counts the drafts."""
    expected = plain_llm.generate(prompts[:2], greedy(MAX_NEW))
    config = SpeculativeConfig(**SPECULATIVE)
    with served_engine(tiny_checkpoint, num_pages=128, page_size=8, speculative_config=config) as (live, _):
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)
        for prompt, want in zip(prompts[:2], expected):
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                               logprobs=1, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            chunks = list(stream)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            assert text == want.outputs[0].text and len(tokens) == MAX_NEW
            assert chunks[-1].usage.completion_tokens == MAX_NEW
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab " * 12}],
                                              max_tokens=MAX_NEW, temperature=0, logprobs=True, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(chat)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert len(entries) == chunks[-1].usage.completion_tokens == MAX_NEW
        metrics = httpx.get(f"{live.base_url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("mili_spec_decode_")}
    assert 0 < values["mili_spec_decode_num_accepted_tokens_total"] < values["mili_spec_decode_num_draft_tokens_total"]
    assert values["mili_spec_decode_num_drafts_total"] > 0


def test_bf16_drafting_decodes_match_plain_decoding(tiny_checkpoint, prompts):
    """In bfloat16 on CPU, a decode with drafts runs through the compiled decode stack as several rows of
    one sequence (each attending to the rows before it): the tokens of plain decoding, logprobs close."""
    args = dict(dtype="bfloat16", num_pages=256, page_size=8)
    plain = LLM(str(tiny_checkpoint), **args).generate(prompts, greedy(MAX_NEW))
    llm = LLM(str(tiny_checkpoint), speculative_config=SPECULATIVE, **args)
    drafted = llm.generate(prompts, greedy(MAX_NEW))
    for want, have in zip(plain, drafted):
        want, have = want.outputs[0], have.outputs[0]
        assert have.token_ids == want.token_ids
        for a, b in zip(have.logprobs, want.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-2)
    assert_drafts_kept_and_rejected(llm)


def test_async_engine_plans_ahead_until_the_text_repeats(tiny_checkpoint, plain_llm):
    """The async engine plans a step ahead while nothing recurs (the overlap is worth more then), and
    stops planning ahead where drafts are found; either way the tokens are plain decoding's."""
    prompts = random_prompts(3, [30, 45, 60], seed=9)  # nothing recurs in them: output repeats come later
    expected = [out.outputs[0].token_ids for out in plain_llm.generate(prompts, greedy(64))]
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=128, page_size=8,
                                      speculative_config=SPECULATIVE))
    planned_ahead = []
    schedule_ahead = engine.core.schedule_ahead
    engine.core.schedule_ahead = lambda running: planned_ahead.append(schedule_ahead(running)) or planned_ahead[-1]

    async def main():
        await engine.start()
        try:
            async def tokens(prompt):
                return [t async for delta in await submit_checked(engine, prompt, greedy(64)) for t in delta.token_ids]
            return await asyncio.gather(*(tokens(p) for p in prompts))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected
    assert any(step is not None for step in planned_ahead) and any(step is None for step in planned_ahead)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    engine.core.check_integrity()


def test_aborts_while_drafting_steps_run_return_every_page(tiny_checkpoint, prompts):
    """Requests aborted mid-stream (their drafting step still on the worker) and finished ones leave
    the pool whole."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=128, page_size=4,
                                      speculative_config=SPECULATIVE))

    async def main():
        await engine.start()
        try:
            async def read(prompt, stop_after):
                stream = await submit_checked(engine, prompt, greedy(MAX_NEW))
                count = 0
                async for delta in stream:
                    count += len(delta.token_ids)
                    if count >= stop_after:
                        await stream.aclose()  # the client went away
                        break
                return count
            return await asyncio.gather(*(read(p, 5 + 3 * i) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()

    counts = asyncio.run(main())
    assert all(count >= 5 for count in counts)
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0 and stats.num_running == stats.num_waiting == 0
    engine.core.check_integrity()
    pages = engine.core.pages
    assert pages.tree.locked_pages == 0 and pages.pool.num_free + pages.tree.cached_pages == pages.num_pages


def test_the_server_logs_its_drafting_at_start(tiny_checkpoint, caplog):
    speculative = SpeculativeConfig(3, prompt_lookup_min=2, prompt_lookup_max=4, disable_by_batch_size=4)
    config = ServerConfig(engine=EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=16,
                                              speculative_config=speculative))
    state = ServerState(config, "tiny")

    async def load():
        await load_engine(state)
        await state.engine.shutdown()

    with caplog.at_level("INFO", logger="mili_openai.server.app"):
        asyncio.run(load())
    assert "speculative decoding: ngram, up to 3 draft tokens from n-grams of 2-4 tokens, off above 4 running " \
           "sequences" in caplog.text
