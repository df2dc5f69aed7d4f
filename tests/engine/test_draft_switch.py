"""The adaptive off-switch (`DraftSwitch`) with a model proposer (MTP, a draft model): once a request's drafts are
mostly rejected it stops drafting, and its steps then cost what plain decoding's cost: the runner's proposer
drafts for none of it (no catch-up rows, no chained drafts), and a step where nothing drafts runs no proposer at
all. Greedy output stays plain decoding's (fp32), and in a batch where some requests still draft, theirs are the
drafts they would get with every request drafting: leaving the others out shifts no row."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_helpers import run_engine, submit_checked
from hybrid_helpers import WrappedDrafter, hybrid_tokens

from mili_openai import LLM, SamplingParams
from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.sampling_params import StructuredOutputsParams

ENGINE = dict(dtype="float32", num_pages=256, page_size=4, max_num_batched_tokens=32)  # chunks beside decodes
PROMPTS = [hybrid_tokens(length, seed=length) for length in (23, 31, 9, 37)]
MAX_NEW = 20
NUM_DRAFTS = 3
# a random MTP head keeps almost no draft: switched off after its first verify step (0 or 1 of 3 kept)
SWITCHING_MTP = {"method": "mtp", "num_speculative_tokens": NUM_DRAFTS, "min_acceptance_rate": 0.5,
                 "min_drafts_for_switch": NUM_DRAFTS, "disable_by_batch_size": None}
ALWAYS_MTP = SWITCHING_MTP | {"min_acceptance_rate": 0}
POLL_S = 0.001  # the test's wait for the engine loop: a poll, whose length changes no result


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


class RecordingDrafter(WrappedDrafter):
    """Wraps the runner's drafter: records each call's `proposes_for` and drafts. Where `compare` is set and a
    call drafts for two sequences or more, it first drafts with the first of them left out, and records both."""

    def __init__(self, inner, compare: bool = False) -> None:
        super().__init__(inner)
        self.compare = compare
        self.calls: list[tuple[list[bool], list[list[int]]]] = []
        self.compared: list[tuple[list[bool], list[list[int]], list[list[int]]]] = []

    def propose(self, plan, *args) -> list[list[int]]:
        drafting = [index for index, on in enumerate(plan.proposes_for) if on]
        if self.compare and len(drafting) >= 2:
            fewer = list(plan.proposes_for)
            fewer[drafting[0]] = False
            # the MTP module keeps only K/V in each sequence's own pages: the full call below rewrites them alike
            partial = self.inner.propose(dataclasses.replace(plan, proposes_for=fewer), *args)
            full = self.inner.propose(plan, *args)
            self.compared.append((fewer, partial, full))
        else:
            full = self.inner.propose(plan, *args)
        self.calls.append((list(plan.proposes_for), full))
        return full


class SwitchedOffFor:
    """A DraftSwitch that turns the requests of some prompts off from their start."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.off = {tuple(prompt) for prompt in prompts}

    def allows(self, seq) -> bool:
        return tuple(seq.prompt_token_ids) not in self.off

    def record(self, seq, num_drafts: int, num_accepted: int) -> None:
        """The others' drafts move no switch: they draft throughout."""


@pytest.fixture(scope="module")
def plain(hybrid_checkpoint):
    """(the tiny Qwen3.5 checkpoint, its greedy tokens without drafts)."""
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    return checkpoint, token_ids(LLM(checkpoint, **ENGINE).generate(PROMPTS, greedy()))


def recording_llm(checkpoint: str, speculative: dict, compare: bool = False) -> tuple[LLM, RecordingDrafter]:
    llm = LLM(checkpoint, speculative_config=speculative, **ENGINE)
    speculation = llm.core.runner.forward.speculation
    speculation.drafter = RecordingDrafter(speculation.drafter, compare)
    return llm, speculation.drafter


def test_a_switched_off_request_runs_no_proposer(plain):
    checkpoint, expected = plain
    llm, drafter = recording_llm(checkpoint, SWITCHING_MTP)
    assert token_ids(llm.generate(PROMPTS, greedy())) == expected
    # every request verified a step of drafts (two, where it kept some), and then none
    assert 0 < llm.core.stats().spec_decode_num_drafts_total <= 2 * len(PROMPTS)
    for proposes_for, drafts in drafter.calls:
        assert all(on or not made for on, made in zip(proposes_for, drafts))
    # once every request is off, no step runs the proposer: its calls stop long before the output ends
    assert len(drafter.calls) < MAX_NEW // 2


def test_a_paused_request_probes_again_and_its_output_stays_plain_decodings(plain):
    """With a short backoff the random head's requests pause, then have drafts verified again (the probes): the
    proposer ran for them after their pause, over K/V of its own that the paused stretch never wrote, which only
    its drafts, never the output, can suffer from."""
    checkpoint, expected = plain
    llm, _ = recording_llm(checkpoint, SWITCHING_MTP | {"switch_backoff_tokens": 3})
    draft_switch = llm.core.scheduler.draft_switch
    verified_at: dict[str, list[int]] = {}  # per sequence, its output's length at each verify step
    record = draft_switch.record

    def recorded(seq, num_drafts, num_accepted):
        verified_at.setdefault(seq.sequence_id, []).append(len(seq.output_token_ids))
        record(seq, num_drafts, num_accepted)

    draft_switch.record = recorded
    assert token_ids(llm.generate(PROMPTS, greedy())) == expected
    assert len(verified_at) == len(PROMPTS)
    # consecutive verify steps are at most 1 + NUM_DRAFTS tokens apart: a wider gap is a pause, then a probe
    for lengths in verified_at.values():
        assert any(after - before > 1 + NUM_DRAFTS for before, after in zip(lengths, lengths[1:]))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (views left out: an MTP engine's KV and state pools, which a step takes
    views of, have other sizes), by name and output shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        shapes = tuple(tuple(tensor.shape) for tensor in (out if isinstance(out, tuple | list) else (out,))
                       if isinstance(tensor, torch.Tensor))
        self.ops[(str(func), shapes)] += 1
        return out


def plain_step_ops(llm: LLM, prompt: list[int]) -> dict[int, Counter]:
    """Greedy-decode `prompt` alone; {a plain decode step's position (no drafts verified, no proposer run): the ops
    its forward and sampling ran}."""
    runner, steps = llm.core.runner, {}
    execute = runner.execute

    def counted(step):
        batch = step.forward.batch
        if step.speculation is not None or batch.prefills:
            return execute(step)
        with OpCounter() as counter:
            output = execute(step)
        steps[int(batch.positions[0])] = counter.ops
        return output

    runner.execute = counted
    llm.generate([prompt], greedy())
    return steps


def test_a_paused_requests_step_runs_what_a_plain_decode_step_runs(plain):
    """Issue 47: a request whose random MTP head paused costs a plain step, exactly: its decode steps run the very
    ops (names and shapes) that an engine without speculation runs at the same positions, nothing more. Counted, not
    timed, so that a busy machine cannot hide an extra op."""
    checkpoint, _ = plain
    engine = ENGINE | {"enable_prefix_caching": False}  # no state snapshots: state pools of one size in both
    expected = plain_step_ops(LLM(checkpoint, **engine), PROMPTS[0])
    paused = plain_step_ops(LLM(checkpoint, speculative_config=SWITCHING_MTP, **engine), PROMPTS[0])
    # the head verified a step of drafts or two, then paused for the rest of the output
    assert len(paused) >= MAX_NEW - 2 * (1 + NUM_DRAFTS) and set(paused) <= set(expected)
    for position, ops in paused.items():
        assert ops == expected[position], position


def test_requests_still_drafting_get_the_same_drafts_beside_switched_off_ones(plain):
    checkpoint, expected = plain
    llm, drafter = recording_llm(checkpoint, ALWAYS_MTP, compare=True)
    llm.core.scheduler.draft_switch = SwitchedOffFor(PROMPTS[1::2])
    assert token_ids(llm.generate(PROMPTS, greedy())) == expected
    assert any(not all(on) and any(on) for on, _ in drafter.calls)  # mixed batches were drafted for
    for proposes_for, drafts in drafter.calls:
        assert all(on or not made for on, made in zip(proposes_for, drafts))
    assert drafter.compared
    for fewer, partial, full in drafter.compared:
        assert [made if on else [] for on, made in zip(fewer, full)] == partial


def test_a_draft_model_follows_the_requests_left_drafting(plain):
    """The target as its own draft: its drafts are kept where its caches follow the accepted tokens exactly, so
    leaving the switched-off requests out of its catch-up must leave the others' drafts nearly all kept."""
    checkpoint, expected = plain
    llm, drafter = recording_llm(checkpoint, {"method": "draft_model", "model": checkpoint,
                                              "num_speculative_tokens": NUM_DRAFTS, "min_acceptance_rate": 0,
                                              "disable_by_batch_size": None})
    llm.core.scheduler.draft_switch = SwitchedOffFor(PROMPTS[1::2])
    assert token_ids(llm.generate(PROMPTS, greedy())) == expected
    assert any(not all(on) and any(on) for on, _ in drafter.calls)
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens_total >= 0.9 * stats.spec_decode_num_draft_tokens_total > 0


def test_the_server_loop_plans_ahead_once_nothing_drafts(hybrid_checkpoint):
    """The async engine's loop: once every running request is switched off, steps are planned while the one before
    runs, as without speculation; requests arriving meanwhile are drafted for from their prompt on, in such steps
    too. Every output is plain decoding's."""
    checkpoint = str(hybrid_checkpoint("qwen3_5_qwen35_tokenizer"))  # the loop loads a whole tokenizer's vocabulary
    expected = token_ids(LLM(checkpoint, **ENGINE).generate(PROMPTS, greedy()))
    engine = AsyncEngine(EngineConfig(model=checkpoint, speculative_config=SWITCHING_MTP, **ENGINE))
    core, planned = engine.core, []
    schedule_ahead = core.schedule_ahead

    def recorded(running):
        ahead = schedule_ahead(running)
        if ahead is not None:
            planned.append(ahead[0].run_proposer)
        return ahead

    core.schedule_ahead = recorded

    async def tokens(stream) -> list[int]:
        return [token for delta in [delta async for delta in stream] for token in delta.token_ids]

    async def work() -> list[list[int]]:
        early = [await submit_checked(engine, PROMPTS[index], greedy()) for index in (0, 2)]
        first = asyncio.ensure_future(tokens(early[0]))
        while not planned and not first.done():  # until the early requests are off and a step is planned ahead
            await asyncio.sleep(POLL_S)
        late = [await submit_checked(engine, PROMPTS[index], greedy()) for index in (1, 3)]
        return await asyncio.gather(first, *(tokens(stream) for stream in (early[1], *late)))

    outputs = run_engine(engine, work)
    assert outputs == [expected[0], expected[2], expected[1], expected[3]]
    assert planned and core.stats().spec_decode_num_drafts_total > 0
    core.check_integrity()


def test_a_format_masks_the_drafts_of_the_requests_left_drafting(hybrid_checkpoint):
    """A structured output's matcher masks a model's drafts after the tokens its sequence kept in the step: with a
    request before it switched off, the step's kept tokens are still its own. Its output is plain decoding's, and
    valid."""
    checkpoint = str(hybrid_checkpoint("qwen3_5_qwen35_tokenizer"))  # a grammar covers a whole tokenizer's vocabulary
    regex = r"[ab]{3,20}"
    params = [greedy(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                       structured_outputs=StructuredOutputsParams(regex=regex))]
    prompts = PROMPTS[:2]
    expected = token_ids(LLM(checkpoint, **ENGINE).generate(prompts, params))
    llm, drafter = recording_llm(checkpoint, ALWAYS_MTP)
    llm.core.scheduler.draft_switch = SwitchedOffFor(prompts[:1])
    outputs = llm.generate(prompts, params)
    assert token_ids(outputs) == expected and re.fullmatch(regex, outputs[1].outputs[0].text)
    assert any(proposes_for == [False, True] and drafts[1] for proposes_for, drafts in drafter.calls)
