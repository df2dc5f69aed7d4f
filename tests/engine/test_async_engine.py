"""The asyncio engine: streaming deltas, stop conditions, aborts, and pages returned to the pool."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_helpers import check_abort_mid_stream_frees_pages, random_prompts, run_engine, submit_checked
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.client import RequestStream
from mili_openai.engine.contract import EngineInfo, RequestError, check_request
from mili_openai.engine.outputs import SequenceDelta, TokenLogprob
from mili_openai.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_pages=64, page_size=8,
                                    max_num_batched_tokens=64, max_model_len=256))


async def collect(stream):
    deltas = [delta async for delta in stream]
    return deltas


def test_stream_ends_with_length_and_usage(engine):
    prompt = random_prompts(1, [20], seed=1)[0]

    async def go():
        return await collect(await submit_checked(engine, prompt,
                                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))

    deltas = run_engine(engine, go)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 6
    assert deltas[-1].num_prompt_tokens == 20 and deltas[-1].num_output_tokens == 6
    engine.core.check_integrity()


def test_stop_token_ids_and_max_tokens_none(engine):
    prompt = random_prompts(1, [12], seed=2)[0]

    async def go():
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        first = await collect(await submit_checked(engine, prompt, greedy))
        tokens = [token for d in first for token in d.token_ids]
        # the first token that did not occur before it: greedy output stops exactly there
        position = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
        stopped = await collect(await submit_checked(engine, prompt, SamplingParams(
            temperature=0, max_tokens=None, stop_token_ids=[tokens[position]], ignore_eos=True)))
        return tokens[position], position, stopped

    stop_id, position, stopped = run_engine(engine, go)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_id
    assert stopped[-1].num_output_tokens == position + 1


def test_context_length_finishes_with_length(engine):
    prompt = random_prompts(1, [250], seed=3)[0]

    async def go():
        return await collect(await submit_checked(engine, prompt,
                                                  SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)))

    deltas = run_engine(engine, go)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 6


def test_invalid_requests_raise_value_error(engine):
    async def go():
        with pytest.raises(ValueError, match="context length"):
            await submit_checked(engine, [1] * 300, SamplingParams())
        with pytest.raises(ValueError, match="context length"):
            await submit_checked(engine, [1] * 200, SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="empty"):
            await submit_checked(engine, [], SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            await submit_checked(engine, [10**9], SamplingParams())

    run_engine(engine, go)


def test_abort_mid_stream_frees_pages(engine):
    check_abort_mid_stream_frees_pages(engine)


def test_stop_string_is_never_emitted(engine):
    prompt = random_prompts(1, [15], seed=6)[0]

    async def go():
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        full = await collect(await submit_checked(engine, prompt, greedy))
        text = "".join(d.text for d in full)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = await collect(await submit_checked(engine, prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True, stop=[stop])))
        return text, stop, cut

    text, stop, cut = run_engine(engine, go)
    got = "".join(d.text for d in cut)
    assert cut[-1].finish_reason == "stop" and cut[-1].stop_reason == stop
    assert got == text[: text.index(stop)]


def test_steps_planned_ahead_give_the_offline_engines_tokens(engine, tiny_checkpoint):
    """Decode steps scheduled while the step before runs feed on its tokens once they exist: greedy and
    seeded outputs match the offline engine's (which never plans ahead), through a stop mid-stream and
    max lengths that differ; then requests whose sampling reads their output so far (penalties, min_tokens),
    which see the pending token too."""
    from mili_openai import LLM

    offline = LLM(str(tiny_checkpoint), dtype="float32", num_pages=64, page_size=8, max_num_batched_tokens=64,
                  max_model_len=256)
    prompts = random_prompts(8, [9, 30, 17], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 5, 9)]
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    params.append(SamplingParams(temperature=0.9, seed=11, max_tokens=12, presence_penalty=1.5,
                                 frequency_penalty=1.0, ignore_eos=True))
    # EOS made the likeliest token: it appears from the 6th token on exactly when the sampler counts the
    # output so far right (one short, and the 6th would still be masked)
    eos = engine.info.eos_token_ids[0]
    params.append(SamplingParams(temperature=0, max_tokens=9, min_tokens=5, logit_bias={eos: 100.0},
                                 ignore_eos=True))
    want = [out.outputs[0].token_ids for out in offline.generate(prompts, params)]
    # a stop token from the middle of the first output ends that request early, with a step in flight
    stop_at = want[0][6]
    params[0] = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[stop_at])
    want[0] = want[0][: want[0].index(stop_at) + 1]

    fed = []  # per prepared step: rows whose input token was pending
    prepare = engine.core.runner.prepare

    def recording_prepare(batch, sample_index=None):
        step = prepare(batch, sample_index)
        fed.append(len(step.pending.rows) if step.pending is not None else 0)
        return step

    def generate(indices):
        async def go():
            streams = [await submit_checked(engine, prompts[i], params[i]) for i in indices]
            return await asyncio.gather(*(collect(s) for s in streams))

        return [[t for d in deltas for t in d.token_ids] for deltas in run_engine(engine, go)]

    engine.core.runner.prepare = recording_prepare
    try:
        assert generate([0, 1, 2, 3]) == want[:4]
        assert max(fed) >= 3  # several decodes fed on pending tokens in one step
        fed.clear()
        assert want[7] == want[7][:5] + [eos] * 4 and eos not in want[7][:5]
        assert generate([4, 5, 6, 7]) == want[4:]
        assert max(fed) == 4  # the penalised and min_tokens rows fed on pending tokens with the others
    finally:
        del engine.core.runner.prepare
    engine.core.check_integrity()
    assert engine.core.pages.tree.locked_pages == 0


def test_loop_thread_runs_torch_serially_and_leaves_the_forward_its_threads(engine):
    # a parallel op on the loop thread would give it an OpenMP team of its own, which makes libgomp
    # stop spinning at the forward's barriers (engine/async_engine.py, serial_torch_ops)
    forward_threads = engine._executor.submit(torch.get_num_threads).result()
    main_threads = torch.get_num_threads()
    # asyncio.run makes this thread the loop thread: give it two threads, so that even on one core the
    # loop would run torch in parallel unless the engine keeps it serial
    torch.set_num_threads(2)

    async def go():
        await asyncio.sleep(0)  # let the engine's loop task enter its body
        loop_threads = torch.get_num_threads()
        prompt = random_prompts(1, [20], seed=9)[0]
        await collect(await submit_checked(engine, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
        return loop_threads, engine._executor.submit(torch.get_num_threads).result()

    try:
        loop_threads, forward_threads_during = run_engine(engine, go)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(main_threads)
    assert loop_threads == 1
    assert forward_threads_during == forward_threads
    assert threads_after == 2  # restored when the loop stopped


def delta(index: int, token: int, finish_reason: str | None = None, logprob: bool = True) -> SequenceDelta:
    return SequenceDelta(request_id="r", text=f"<{token}>" if finish_reason != "abort" else "",
                         token_ids=[token] if finish_reason != "abort" else [],
                         logprobs=[TokenLogprob(token, -1.0, [])] if logprob else None, finish_reason=finish_reason,
                         stop_reason=None, num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=token,
                         index=index)


def test_a_consumer_behind_the_engine_reads_each_samples_queued_deltas_merged():
    """Deltas queued before the consumer reads: one merged delta per run of one sample, in order, never
    across another sample's delta, never past a final one; an abort without logprobs keeps the others'."""
    async def go():
        stream = RequestStream("r", 2, abort=lambda request_id: None)
        for queued in (delta(0, 1), delta(0, 2), delta(1, 1), delta(0, 3), delta(0, 4, "length"),
                       delta(1, 2), delta(1, 3, "abort", logprob=False)):
            stream.put(queued)
        return [read async for read in stream]

    read = asyncio.run(go())
    assert [(d.index, d.token_ids, d.text, d.finish_reason) for d in read] == [
        (0, [1, 2], "<1><2>", None), (1, [1], "<1>", None), (0, [3, 4], "<3><4>", "length"),
        (1, [2], "<2>", "abort")]
    assert [len(d.logprobs) for d in read] == [2, 1, 2, 1]
    assert read[2].num_output_tokens == 4


def test_a_consumer_keeping_up_reads_every_delta_as_it_comes():
    async def go():
        stream = RequestStream("r", 1, abort=lambda request_id: None)
        reads = []
        for token in (1, 2, 3):
            stream.put(delta(0, token, "stop" if token == 3 else None))
            reads.append(await anext(stream))
        return reads

    assert [d.token_ids for d in asyncio.run(go())] == [[1], [2], [3]]


def test_a_stream_the_engine_can_no_longer_feed_ends_every_unfinished_sample():
    """`end` (an engine process that died): a final "abort" for each sample still owed one, the last one
    finishing the request; a sample that finished already gets none."""
    async def go():
        stream = RequestStream("r", 3, abort=lambda request_id: None)
        stream.put(delta(1, 1, "length"))
        stream.end("engine error: gone")
        return [read async for read in stream]

    read = asyncio.run(go())
    assert [(d.index, d.finish_reason, d.error, d.request_finished) for d in read] == [
        (1, "length", None, False), (0, "abort", "engine error: gone", False),
        (2, "abort", "engine error: gone", True)]


def test_the_request_check_names_the_field_and_resolves_max_tokens():
    info = EngineInfo(tokenizer=None, model_path=None, max_model_len=16, vocab_size=100, eos_token_ids=(0,),
                      quantization=None, sampling_defaults={})
    assert check_request([1, 2, 3], SamplingParams(max_tokens=None), info).max_tokens == 13  # what the context leaves
    assert check_request([1, 2, 3], SamplingParams(max_tokens=5), info).max_tokens == 5
    with pytest.raises(RequestError, match="16 tokens are in the messages") as too_long:
        check_request([1] * 16, SamplingParams(max_tokens=None), info, prompt_field="messages")
    assert too_long.value.param == "messages"
    with pytest.raises(RequestError, match="Please reduce the length of the prompt") as too_many:
        check_request([1] * 10, SamplingParams(max_tokens=7), info)
    assert too_many.value.param is None  # a caller that names no field gets none named (the completions API)
    with pytest.raises(RequestError) as chat_too_many:
        check_request([1] * 10, SamplingParams(max_tokens=7), info, prompt_field="messages")
    assert chat_too_many.value.param == "max_tokens"
