"""Asynchronous launch's hand-off between two steps: the ids one step samples (`LaunchedStep`) and the rows of the
step planned after it that read them (`PendingTokens`).

A step planned while the step before runs (`EngineCore.schedule_ahead`) has decode rows whose input token that
step is still sampling; the builder gives them id 0 (engine/batch_builder.py). When the step launches, `feed`
writes the sampled ids in, one gather, on the device where the step's inputs already are:

    step N     launch: forward ─ sample ─► token_ids (on the device) ··· finish ─► output (on the host)
                                              │ input_ids[rows] = token_ids[sources]
    step N+1   launch: inputs to the device ─ feed ─ forward ─ sample ─► ...

On CUDA the gather is queued behind step N's sampling, so step N+1 may launch before step N finishes; on the host
(CPU, and a tensor-parallel engine's inputs) it reads step N's ids once computed. Rows whose sampling reads their
output so far (penalties, min_tokens) also need the token in that list on the host (`histories`): they, and a
structured output whose matcher step N advances at its finish, make step N+1 wait for that finish
(`needs_host_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mili_openai.engine.sampler import SamplerOutput
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step queued on the model's device and not yet finished (`ModelRunner.launch`): what its sampling left
    on the device, and once finished (`ModelRunner.finish`), its output on the host."""

    sampled: Any  # what the sampler's finish reads (its PendingSample); None where the step sampled nothing
    token_ids: torch.Tensor | None  # (S,) the sampled ids on the device, where the step after can read them
    prompt_logprobs: dict | None = None  # SamplerOutput.prompt_logprobs, scored at launch
    pooled: dict | None = None  # SamplerOutput.pooled, reduced at launch
    proposed_drafts: list[list[int]] | None = None  # SamplerOutput.proposed_drafts, made at launch
    source: LaunchedStep | None = None  # the step whose sampled ids this one read (None: none), until finished
    output: SamplerOutput | None = None  # set by a successful finish
    failed: bool = False

    @classmethod
    def nothing_sampled(cls) -> LaunchedStep:
        """A finished step that sampled nothing: what the first step comes after."""
        return cls(None, None, output=SamplerOutput([], []))

    def host_ids(self) -> np.ndarray:
        """(S,) the sampled ids on the host: computed there (CPU), or brought back by the finish."""
        if self.token_ids is not None and self.token_ids.device.type == "cpu":
            return self.token_ids.numpy()
        if self.output is None:
            raise RuntimeError("this step needs the tokens of the step before on the host: finish that one first")
        return np.asarray(self.output.token_ids, dtype=np.int64)


@dataclass(slots=True)
class PendingTokens:
    """A step's input rows whose token the step before is still sampling (see the module docstring)."""

    rows: np.ndarray  # (P,) int64: the input rows
    sources: np.ndarray  # (P,) int64: each one's index among the step before's sampled rows
    # rows whose sampling reads the output so far (penalties, min_tokens): their own copy of that list, which the
    # pending token joins at `feed`, and the token's index among the sampled rows
    histories: list[tuple[list[int], int]]
    needs_host_tokens: bool  # the step launches only once the step before has finished (the module docstring)
    # (2, P) int64 rows over sources, staged (pinned on CUDA) for a device's gather; None where inputs stay on the host
    index: torch.Tensor | None = None

    def feed(self, input_ids: torch.Tensor, source: LaunchedStep | None) -> None:
        """Write the step before's sampled ids (`source`'s; None: its launch failed) into `input_ids`, on their
        device, and into `histories`. The step's finish fails if `source` fails (its finish may come later)."""
        if source is None or source.failed:
            raise RuntimeError("the step before failed, so the tokens this step feeds on do not exist")
        if self.needs_host_tokens and source.output is None:
            raise RuntimeError("this step needs the tokens of the step before on the host: finish that one first")
        if input_ids.device.type == "cpu":
            # numpy, no torch op: from the end of one step (when the event loop wakes to postprocess it) to the
            # compiled decode stack of the next, this thread then releases no GIL for the loop to take
            input_ids.numpy()[self.rows] = source.host_ids()[self.sources]
        else:
            self.gather_on_device(input_ids, source.token_ids)
        if self.histories:
            sampled = source.output.token_ids
            for history, token in self.histories:
                history.append(sampled[token])

    def gather_on_device(self, input_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
        """input_ids[rows] = token_ids[sources], queued on their device (behind the step before's sampling)."""
        index = self.index.to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], token_ids.index_select(0, index[1]))


def pending_inputs(batch: ScheduledBatch, sample_index: dict[Sequence, int]) -> tuple[list[int], list[int]]:
    """(rows, sources): the decode rows whose input token is still pending, and for each the index of
    its sequence among the sampled rows of the step before (`sample_index`), which is sampling it."""
    rows, sources = [], []
    row = 0
    for seq, position, num_new in zip(batch.seqs[: batch.num_decode], batch.positions, batch.num_new_tokens):
        if position == len(seq.token_ids):
            rows.append(row)
            sources.append(sample_index[seq])
        row += num_new  # a decode with drafts has one row for each
    return rows, sources
