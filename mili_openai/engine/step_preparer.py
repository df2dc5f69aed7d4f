"""A step's inputs, built on the event loop's thread, and the tokens one step feeds the next: the part of a
runner that the one-process `ModelRunner` and the `TensorParallelRunner` share (engine/runner.py,
engine/tp_runner.py). Neither the model nor the KV cache is touched here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mili_openai.engine.batch_builder import (
    PageArrays,
    PromptScoring,
    build_forward_batch,
    pending_inputs,
    pooling_rows,
    prompt_scorings,
    row_lora_ids,
)
from mili_openai.engine.image_batch import vision_batch
from mili_openai.engine.pooling_spec import PoolingRow
from mili_openai.engine.sampler import SamplerOutput, SamplingRow
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.speculation import SpeculationPlan, plan_speculation
from mili_openai.engine.step_inputs import stage_forward_batch
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.rope import RotaryTable


@dataclass(slots=True)
class PreparedStep:
    forward_batch: ForwardBatch
    rows: list[SamplingRow]  # per sampling sequence, one, or one per row with drafts; in logits_indices order
    # input rows whose token the step before is sampling, and that token's index among its samples
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    # sampling rows that read their output so far (penalties, min_tokens) and whose last token is one of
    # those: the row's own copy of its output ids, which the pending token joins, and the token's index
    pending_histories: list[tuple[list[int], int]] = field(default_factory=list)
    prompt_scorings: list[PromptScoring] = field(default_factory=list)  # prompt tokens the step scores
    staged: torch.Tensor | None = None  # on CUDA: the pinned buffer holding forward_batch's tensors
    # (2, P) int64 (pinned on CUDA): pending_rows over pending_sources, where steps are fed on the device
    pending_index: torch.Tensor | None = None
    # (N,) int64: state slots handed out in this step, zeroed before its forward (ScheduledBatch.new_state_slots)
    new_state_slots: torch.Tensor | None = None
    pooling_rows: list[PoolingRow] = field(default_factory=list)  # pooling requests' chunks (engine/pooler.py)
    # (T,) each row's LoRA adapter id (0: the base model); None when every row runs on the base
    lora_ids: np.ndarray | None = None
    speculation: SpeculationPlan | None = None  # drafts to verify or to make (engine/speculation.py)
    # (2, N) int64 source and destination state slots (ScheduledBatch.state_restores / state_saves): copied
    # before the forward (after the zeroing), and after it
    state_restores: torch.Tensor | None = None
    state_saves: torch.Tensor | None = None

    @property
    def needs_host_tokens(self) -> bool:
        """Whether its launch needs the tokens the step before sampled on the host, not only on the device:
        rows reading their output so far (penalties, min_tokens), or a structured output whose matcher the
        step before advances when it finishes."""
        if self.pending_histories:
            return True
        return bool(self.pending_rows) and any(row.grammar is not None for row in self.rows)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step queued on the model's device and not yet finished (`StepPreparer.launch`): what its sampling
    left on the device, and once finished, its output on the host."""

    sampled: Any  # the runner's own: what its finish reads (the sampler's PendingSample on a ModelRunner)
    token_ids: torch.Tensor | None  # (S,) the sampled ids on the device, where the step after can read them
    prompt_logprobs: dict | None = None  # SamplerOutput.prompt_logprobs, scored at launch
    pooled: dict | None = None  # SamplerOutput.pooled, reduced at launch
    source: LaunchedStep | None = None  # the step whose device ids this one's pending rows read
    output: SamplerOutput | None = None  # set by a successful finish
    proposed_drafts: list[list[int]] | None = None  # SamplerOutput.proposed_drafts, made at launch
    failed: bool = False


# launch_forward(step, source): queue the step's forward and sampling, reading its pending input ids from
# source.token_ids on the device where source is given (they are in the step's input ids otherwise)
LaunchForward = Callable[[PreparedStep, LaunchedStep | None], LaunchedStep]


class StepPreparer:
    """Builds `PreparedStep`s for a model with `page_size`-token pages, and feeds each the tokens the step
    before it sampled."""

    def __init__(self, device: torch.device, page_size: int, rotary_table: RotaryTable,
                 feed_on_device: bool = False, pin_memory: bool | None = None, serves_lora: bool = False) -> None:
        """feed_on_device: steps read their pending input ids from the step before's sampled ids on the
        device (so they may launch before it finishes), unless they need them on the host. pin_memory: stage
        a device's inputs in pinned memory (None: on CUDA; a stand-in device without CUDA cannot pin).
        serves_lora: rows may run LoRA adapters (else no step looks for their ids)."""
        self.device = device
        self.serves_lora = serves_lora
        self.pin_memory = device.type == "cuda" if pin_memory is None else pin_memory
        self.feed_on_device = feed_on_device
        self.page_size = page_size
        self.rotary_table = rotary_table  # grown and read on the loop thread only
        self.page_arrays = PageArrays()  # likewise
        self._own_rows: dict[Sequence, SamplingRow] = {}  # likewise (see `prepare`)
        # the last step launched (at first, a finished one that sampled nothing); None after a failed
        # launch (the one after it, which may feed on its tokens, fails too)
        self._previous: LaunchedStep | None = LaunchedStep(None, None, output=SamplerOutput([], []))

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> PreparedStep:
        """Build the step's inputs on the loop thread (it owns the sequences being read).

        sample_index: for a step planned while another runs, each sequence's index among that step's
        sampled rows, where decodes find the tokens still pending.
        """
        pending_rows, pending_sources = pending_inputs(batch, sample_index) if sample_index else ([], [])
        pending_source_of = dict(zip(pending_rows, pending_sources))
        rows, pending_histories = [], []
        # a row reading the sequence's own output list is the same every step: kept for the sequences
        # sampled in the step before, rather than built anew for every sequence of every step
        previous_rows, own_rows = self._own_rows, {}
        for index, seq in enumerate(batch.seqs):
            if not batch.samples[index]:
                continue
            history = seq.output_token_ids
            source = pending_source_of.get(index)
            if source is not None and seq.params.reads_output_history:
                # A copy: the loop appends the pending token to the sequence when its step is
                # postprocessed, which may be before or after this step samples.
                history = list(history)
                pending_histories.append((history, source))
                row = None
            else:
                row = previous_rows.get(seq)
            if row is None:
                row = SamplingRow(params=seq.params, generator=seq.generator,
                                  prompt_token_ids=seq.prompt_token_ids, output_token_ids=history, grammar=seq.grammar)
            if history is seq.output_token_ids:
                own_rows[seq] = row
            rows.append(row)
            drafts = batch.drafts(index)
            for count in range(1, len(drafts) + 1):
                # the row after the count-th draft: its sample counts only if the drafts before it are
                # accepted, so it samples as if they were (penalties and min_tokens see them)
                draft_history = [*history, *drafts[:count]] if seq.params.reads_output_history else history
                rows.append(SamplingRow(params=seq.params, generator=seq.generator,
                                        prompt_token_ids=seq.prompt_token_ids, output_token_ids=draft_history,
                                        grammar=seq.grammar, grammar_drafts=drafts[:count]))
        self._own_rows = own_rows
        forward_batch = build_forward_batch(batch, self.page_size, self.page_arrays)
        forward_batch.vision = vision_batch(batch)
        staged = None
        if self.device.type == "cpu":
            # here rather than in the forward: see `_feed_pending_tokens`
            last_position = max(start + count - 1 for start, count in zip(batch.positions, batch.num_new_tokens))
            with torch.inference_mode():
                forward_batch.rotary = self.rotary_table(forward_batch.positions, last_position)
        else:  # packed for one copy to the GPU, while the step before runs (step_inputs.py)
            forward_batch, staged = stage_forward_batch(forward_batch, self.pin_memory)
        pending_index = None
        if pending_rows and self.feed_on_device:
            pending_index = torch.tensor([pending_rows, pending_sources], dtype=torch.int64,
                                         pin_memory=self.pin_memory)
        new_state_slots = torch.tensor(batch.new_state_slots, dtype=torch.int64) if batch.new_state_slots else None
        return PreparedStep(forward_batch, rows, pending_rows, pending_sources, pending_histories,
                            prompt_scorings(batch, forward_batch), staged, pending_index, new_state_slots,
                            pooling_rows(batch, forward_batch),
                            row_lora_ids(batch) if self.serves_lora else None, plan_speculation(batch),
                            _slot_pairs(batch.state_restores), _slot_pairs(batch.state_saves))

    def launch(self, step: PreparedStep, launch_forward: LaunchForward) -> LaunchedStep:
        """Feed `step` the tokens the step before sampled and queue its forward and sampling
        (`launch_forward`). Steps launch one after another, in the order they were scheduled, each on one
        thread. Where the preparer feeds on the device, a step may launch before the one before it finishes
        (`finish`), unless `step.needs_host_tokens`; else that one must have finished."""
        previous = self._previous
        try:
            source = None
            if step.pending_rows:
                if previous is None or previous.failed:
                    raise RuntimeError("the step before failed, so the tokens this step feeds on do not exist")
                if self.feed_on_device and not step.needs_host_tokens:
                    source = previous
                elif previous.output is None:
                    raise RuntimeError("this step needs the tokens of the step before on the host: "
                                       "finish that one first")
                else:
                    self._feed_pending_tokens(step, previous.output.token_ids)
            launched = launch_forward(step, source)
        except BaseException:
            self._previous = None
            raise
        launched.source = source
        self._previous = launched
        return launched

    def finish(self, launched: LaunchedStep, finish_sample: Callable[[Any], SamplerOutput]) -> SamplerOutput:
        """Wait for a launched step and bring its output to the host (`finish_sample(launched.sampled)`, the
        sampler's `finish` on a runner); steps finish in the order they launched. A step whose pending tokens
        came from a step that failed fails too."""
        try:
            if launched.source is not None and launched.source.failed:
                raise RuntimeError("the step before failed, so the tokens this step fed on do not exist")
            if launched.sampled is None:
                output = SamplerOutput(token_ids=[], logprobs=[])
            else:
                output = finish_sample(launched.sampled)
            output = output._replace(prompt_logprobs=launched.prompt_logprobs, pooled=launched.pooled,
                                     proposed_drafts=launched.proposed_drafts)
        except BaseException:
            launched.failed = True
            raise
        finally:
            launched.source = None  # read: let the step before go (each would hold the one before it)
        launched.output = output
        return output

    def _feed_pending_tokens(self, step: PreparedStep, sampled: list[int]) -> None:
        """Put the tokens the step before sampled (finished: on the host) into this step's input ids, and
        into the output so far of the rows whose sampling reads it (`PreparedStep.pending_histories`).

        Through numpy, which keeps the GIL: from the end of one step (when the event loop wakes to
        postprocess it) to the compiled decode stack of the next, this thread calls no torch op. Each
        would release the GIL, the loop would take it for its Python, and the next forward would wait
        that long to start.
        """
        input_ids = step.forward_batch.input_ids.numpy()
        for row, source in zip(step.pending_rows, step.pending_sources):
            input_ids[row] = sampled[source]
        for history, source in step.pending_histories:
            history.append(sampled[source])


def _slot_pairs(pairs: list[tuple[int, int]]) -> torch.Tensor | None:
    """(2, N) int64: the sources, then the destinations; None for no pair."""
    return torch.tensor(pairs, dtype=torch.int64).T.contiguous() if pairs else None


class StepRunner:
    """A runner's step methods over its `steps` (a StepPreparer), its `sampler` and its `_launch_forward`
    (the one-process `ModelRunner` and the `TensorParallelRunner`)."""

    steps: StepPreparer
    sampler: Any  # engine/sampler.py's Sampler

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> PreparedStep:
        return self.steps.prepare(batch, sample_index)

    def launch(self, step: PreparedStep) -> LaunchedStep:
        return self.steps.launch(step, self._launch_forward)

    def finish(self, launched: LaunchedStep) -> SamplerOutput:
        return self.steps.finish(launched, self.sampler.finish)

    def execute(self, step: PreparedStep) -> SamplerOutput:
        return self.finish(self.launch(step))

    def _launch_forward(self, step: PreparedStep, source: LaunchedStep | None) -> LaunchedStep:
        raise NotImplementedError
