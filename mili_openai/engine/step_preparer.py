"""A step's inputs, built on the event loop's thread: the pipeline's first stage (engine/runner.py). Neither the
model nor the KV cache is touched here.

A `PreparedStep` is what the forward reads (`ForwardStep`, sent as it is to tensor-parallel workers) and what the
runner's own process adds around it: the sampling rows, the tokens pending from the step before, the speculation
plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mili_openai.engine.batch_builder import (
    PageArrays,
    PromptScoring,
    build_forward_batch,
    pooling_rows,
    prompt_scorings,
    row_lora_ids,
)
from mili_openai.engine.image_batch import vision_batch
from mili_openai.engine.pending_tokens import PendingTokens, pending_inputs
from mili_openai.engine.pooling_spec import PoolingRow
from mili_openai.engine.sampler import SamplingRow
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.speculation import SpeculationPlan, plan_speculation
from mili_openai.engine.step_inputs import stage_forward_batch
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.rope import RotaryTable


@dataclass(slots=True)
class ForwardStep:
    """What a step's forward reads (`StepForward.run`): host tensors and plain data, no sampling state."""

    batch: ForwardBatch
    num_sampled: int  # rows of `batch.logits_indices` whose logits the step samples from (0: none)
    prompt_scorings: list[PromptScoring] = field(default_factory=list)  # prompt tokens the step scores
    staged: torch.Tensor | None = None  # on CUDA: the pinned buffer holding `batch`'s tensors
    # (N,) int64: state slots handed out in this step, zeroed before its forward (ScheduledBatch.new_state_slots)
    new_state_slots: torch.Tensor | None = None
    # (2, N) int64 source and destination state slots (ScheduledBatch.state_restores / state_saves): copied
    # before the forward (after the zeroing), and after it
    state_restores: torch.Tensor | None = None
    state_saves: torch.Tensor | None = None
    pooling_rows: list[PoolingRow] = field(default_factory=list)  # pooling requests' chunks (engine/pooler.py)
    # (T,) each row's LoRA adapter id (0: the base model); None when every row runs on the base
    lora_ids: np.ndarray | None = None


@dataclass(slots=True)
class PreparedStep:
    forward: ForwardStep
    rows: list[SamplingRow]  # per sampling sequence, one, or one per row with drafts; in logits_indices order
    pending: PendingTokens | None = None  # input rows whose token the step before is sampling; None: none
    speculation: SpeculationPlan | None = None  # drafts to verify or to make (engine/speculation.py)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether it launches only once the step before has finished (PendingTokens.needs_host_tokens)."""
        return self.pending is not None and self.pending.needs_host_tokens


class StepPreparer:
    """Builds `PreparedStep`s for a model with `page_size`-token pages."""

    def __init__(self, device: torch.device, page_size: int, rotary_table: RotaryTable,
                 pin_memory: bool | None = None, serves_lora: bool = False) -> None:
        """device: the model's. pin_memory: stage a device's inputs in pinned memory (None: on CUDA; a stand-in
        device without CUDA cannot pin). serves_lora: rows may run LoRA adapters (else no step looks for their
        ids)."""
        self.device = device
        self.serves_lora = serves_lora
        self.pin_memory = device.type == "cuda" if pin_memory is None else pin_memory
        self.page_size = page_size
        self.rotary_table = rotary_table  # grown and read on the loop thread only
        self.page_arrays = PageArrays()  # likewise
        self._own_rows: dict[Sequence, SamplingRow] = {}  # likewise (see `prepare`)

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> PreparedStep:
        """Build the step's inputs on the loop thread (it owns the sequences being read).

        sample_index: for a step planned while another runs, each sequence's index among that step's
        sampled rows, where decodes find the tokens still pending.
        """
        pending_rows, pending_sources = pending_inputs(batch, sample_index) if sample_index else ([], [])
        rows, histories = self._sampling_rows(batch, dict(zip(pending_rows, pending_sources)))
        forward_batch = build_forward_batch(batch, self.page_size, self.page_arrays)
        forward_batch.vision = vision_batch(batch)
        staged = None
        if self.device.type == "cpu":
            # here rather than in the forward: the forward thread runs no torch op before the model's
            # (PendingTokens.feed)
            last_position = max(start + count - 1 for start, count in zip(batch.positions, batch.num_new_tokens))
            with torch.inference_mode():
                forward_batch.rotary = self.rotary_table(forward_batch.positions, last_position)
        else:  # packed for one copy to the GPU, while the step before runs (step_inputs.py)
            forward_batch, staged = stage_forward_batch(forward_batch, self.pin_memory)
        pending = None
        if pending_rows:
            index = (torch.tensor([pending_rows, pending_sources], dtype=torch.int64, pin_memory=self.pin_memory)
                     if self.device.type != "cpu" else None)
            host_tokens = bool(histories) or any(row.grammar is not None for row in rows)
            pending = PendingTokens(np.asarray(pending_rows, dtype=np.int64),
                                    np.asarray(pending_sources, dtype=np.int64), histories, host_tokens, index)
        new_state_slots = torch.tensor(batch.new_state_slots, dtype=torch.int64) if batch.new_state_slots else None
        forward = ForwardStep(forward_batch, len(rows), prompt_scorings(batch, forward_batch), staged, new_state_slots,
                              _slot_pairs(batch.state_restores), _slot_pairs(batch.state_saves),
                              pooling_rows(batch, forward_batch), row_lora_ids(batch) if self.serves_lora else None)
        return PreparedStep(forward, rows, pending, plan_speculation(batch))

    def _sampling_rows(self, batch: ScheduledBatch, pending_source_of: dict[int, int]
                       ) -> tuple[list[SamplingRow], list[tuple[list[int], int]]]:
        """(the step's sampling rows, PendingTokens.histories): `pending_source_of` maps the pending rows to
        their tokens' indices among the step before's samples (read by batch index, as in `pending_inputs`' rows
        of decodes without drafts)."""
        rows, histories = [], []
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
                histories.append((history, source))
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
        return rows, histories


def _slot_pairs(pairs: list[tuple[int, int]]) -> torch.Tensor | None:
    """(2, N) int64: the sources, then the destinations; None for no pair."""
    return torch.tensor(pairs, dtype=torch.int64).T.contiguous() if pairs else None
