"""`PendingTokens.feed`: the one path by which a step planned ahead takes the tokens the step before samples
(engine/pending_tokens.py), on the host through numpy and on a device as a gather queued there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mili_openai.engine.pending_tokens import LaunchedStep, PendingTokens
from mili_openai.engine.sampler import SamplerOutput

SAMPLED = [7, 8]  # the step before's samples
FED = [8, 0, 7]  # rows 0 and 2 read samples 1 and 0; row 1 (a prefill's, say) keeps its id


def pending(histories: list[tuple[list[int], int]] | None = None) -> PendingTokens:
    rows, sources = [0, 2], [1, 0]
    return PendingTokens(np.array(rows), np.array(sources), histories or [], needs_host_tokens=bool(histories),
                         index=torch.tensor([rows, sources]))


def launched(finished: bool, device: str = "cpu") -> LaunchedStep:
    step = LaunchedStep(sampled=None, token_ids=torch.tensor(SAMPLED, device=device))
    if finished:
        step.output = SamplerOutput(token_ids=list(SAMPLED), logprobs=[None] * len(SAMPLED))
    return step


@pytest.mark.parametrize("finished", [False, True])
def test_host_inputs_read_the_sampled_ids_finished_or_not(finished):
    input_ids = torch.zeros(3, dtype=torch.int64)
    pending().feed(input_ids, launched(finished))
    assert input_ids.tolist() == FED


def test_the_device_gather_writes_the_same_rows():
    """The gather a CUDA step queues behind the step before's sampling, run here on CPU tensors."""
    input_ids = torch.zeros(3, dtype=torch.int64)
    pending().gather_on_device(input_ids, torch.tensor(SAMPLED))
    assert input_ids.tolist() == FED


def test_host_inputs_after_sampling_on_a_device_wait_for_its_finish():
    """A tensor-parallel engine feeds its host inputs from a step sampled on its GPU: from the finished output."""
    input_ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="finish that one first"):
        pending().feed(input_ids, launched(finished=False, device="meta"))
    pending().feed(input_ids, launched(finished=True, device="meta"))
    assert input_ids.tolist() == FED


def test_histories_take_the_token_once_the_step_before_finished():
    history = [1, 2]
    tokens = pending([(history, 1)])
    assert tokens.needs_host_tokens
    with pytest.raises(RuntimeError, match="finish that one first"):
        tokens.feed(torch.zeros(3, dtype=torch.int64), launched(finished=False))
    assert history == [1, 2]
    tokens.feed(torch.zeros(3, dtype=torch.int64), launched(finished=True))
    assert history == [1, 2, SAMPLED[1]]


def test_no_tokens_from_a_step_that_failed():
    failed = launched(finished=False)
    failed.failed = True
    for source in (None, failed):  # None: its launch failed
        with pytest.raises(RuntimeError, match="the step before failed"):
            pending().feed(torch.zeros(3, dtype=torch.int64), source)
