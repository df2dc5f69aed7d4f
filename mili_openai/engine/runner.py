"""The model runner: one step pipeline, prepare -> launch -> finish, over a `StepForward` (engine/step_forward.py):
the model in this process (`LocalForward`) or sharded over tensor-parallel workers (`TensorParallelForward`).

    loop thread                          (CPU: the worker thread)                  worker thread
    prepare(batch) ─► PreparedStep ─► launch(step) ───────────────────────────► finish(launched)
      step_preparer.py: ForwardBatch,    forward.inputs: to the device            sampler.finish: wait for the
      sampling rows, pending tokens      pending.feed: the step before's ids      copies, read the ids and
      (pending_tokens.py)                forward.run: states, model, logits       logprobs ─► SamplerOutput
                                         sampler.launch, speculation
                                         ─► LaunchedStep (ids on the device)

Everything a step reads is built on the loop thread beforehand (`prepare`). On CPU launching computes the step, so
`execute` (launch then finish) runs on the engine's worker thread while the loop streams; on CUDA
(`async_launch`) launching only queues work on the GPU, so the loop launches each step itself, a step ahead of the
one finishing, and the worker waits for each in `finish`. Steps launch in the order they were scheduled, and
finish in the order they launched; a step planned while the one before runs reads that one's sampled ids
(`PendingTokens`), so a step whose source failed fails too.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from mili_openai.config import EngineConfig
from mili_openai.engine.local_forward import LocalForward
from mili_openai.engine.pending_tokens import LaunchedStep
from mili_openai.engine.pooling_spec import PoolingSpec
from mili_openai.engine.sampler import Sampler, SamplerOutput
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.step_forward import ForwardOutput, LoadedModel, StepForward
from mili_openai.engine.step_preparer import PreparedStep, StepPreparer
from mili_openai.model.batch import ForwardBatch


class Runner(LoadedModel, Protocol):
    """What the engine needs of a model runner: `ModelRunner` (or a stand-in, scripts/engine_overlap.py)."""

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> PreparedStep:
        """Build the step's inputs on the loop thread (StepPreparer.prepare)."""

    def launch(self, step: PreparedStep) -> LaunchedStep:
        """Queue one step's forward and sampling."""

    def finish(self, launched: LaunchedStep) -> SamplerOutput:
        """Wait for a launched step and read its output on the host."""

    def execute(self, step: PreparedStep) -> SamplerOutput:
        """Run one step's forward and sampling: `finish(launch(step))`."""


class ModelRunner:
    """The step pipeline (a `Runner`; see the module docstring) over `forward`."""

    def __init__(self, config: EngineConfig, forward: StepForward) -> None:
        self.forward = forward
        # what the engine sizes itself by, as the forward found it at load
        self.device, self.model_config, self.quantization = forward.device, forward.model_config, forward.quantization
        self.num_pages, self.num_state_slots = forward.num_pages, forward.num_state_slots
        self.num_state_snapshots, self.state_slot_bytes = forward.num_state_snapshots, forward.state_slot_bytes
        self.lora, self.async_launch = forward.lora, forward.async_launch
        self.preparer = StepPreparer(self.device, config.page_size, forward.rotary_table,
                                     serves_lora=self.lora is not None)
        self.sampler = Sampler(vocab_size=self.model_config.vocab_size, eos_token_ids=self.model_config.eos_token_ids,
                               device=self.device, seed=config.seed, kernel=forward.cpu_kernels)
        # the last step launched (at first, a finished one that sampled nothing); None after a failed launch
        # (the one after it, which may feed on its tokens, fails too)
        self._previous: LaunchedStep | None = LaunchedStep.nothing_sampled()

    @classmethod
    def load(cls, config: EngineConfig, model_path: Path) -> ModelRunner:
        """The model in this process, or sharded over `tensor_parallel_size` worker processes."""
        if config.tensor_parallel_size > 1:
            from mili_openai.engine.tp_forward import TensorParallelForward  # spawns processes: only when asked

            return cls(config, TensorParallelForward(config, model_path))
        return cls(config, LocalForward(config, model_path))

    @property
    def failure(self) -> str | None:
        return self.forward.failure

    @property
    def kernel_build(self) -> Future[bool] | None:
        return self.forward.kernel_build

    def prepare(self, batch: ScheduledBatch, sample_index: dict[Sequence, int] | None = None) -> PreparedStep:
        return self.preparer.prepare(batch, sample_index)

    @torch.inference_mode()
    def launch(self, step: PreparedStep) -> LaunchedStep:
        """Feed `step` the tokens the step before sampled and queue its forward and sampling (on CPU: run them).
        Unless `step.needs_host_tokens`, a step may launch before the one before it finishes."""
        previous = self._previous
        try:
            batch = self.forward.inputs(step.forward)
            if step.pending is not None:
                step.pending.feed(batch.input_ids, previous)
            launched = self._sample(step, batch, self.forward.run(step.forward, batch))
        except BaseException:
            self._previous = None
            raise
        launched.source = previous if step.pending is not None else None
        self._previous = launched
        return launched

    def finish(self, launched: LaunchedStep) -> SamplerOutput:
        """Wait for a launched step and bring its output to the host."""
        try:
            if launched.source is not None and launched.source.failed:
                raise RuntimeError("the step before failed, so the tokens this step fed on do not exist")
            output = (self.sampler.finish(launched.sampled) if launched.sampled is not None
                      else SamplerOutput(token_ids=[], logprobs=[]))
            output = output._replace(prompt_logprobs=launched.prompt_logprobs, pooled=launched.pooled,
                                     proposed_drafts=launched.proposed_drafts)
        except BaseException:
            launched.failed = True
            raise
        finally:
            launched.source = None  # read: let the step before go (each would hold the one before it)
        launched.output = output
        return output

    def execute(self, step: PreparedStep) -> SamplerOutput:
        return self.finish(self.launch(step))

    def _sample(self, step: PreparedStep, batch: ForwardBatch, out: ForwardOutput) -> LaunchedStep:
        """Queue the step's sampling, then its speculation's part (rejected drafts' states rolled back, the next
        step's drafts made)."""
        speculation = self.forward.speculation
        if out.logits is None:
            if speculation is not None:  # a model proposer reads the chunks too
                speculation.after_sampling(step.speculation, batch, out.hidden, None)
            return LaunchedStep(None, None, prompt_logprobs=out.prompt_logprobs, pooled=out.pooled)
        sampled = self.sampler.launch(out.logits, step.rows)
        drafts = None
        if speculation is not None:
            drafts = speculation.after_sampling(step.speculation, batch, out.hidden, sampled.token_ids)
        return LaunchedStep(sampled, sampled.token_ids, prompt_logprobs=out.prompt_logprobs, pooled=out.pooled,
                            proposed_drafts=drafts)

    def switch_to_cpu_kernels(self) -> None:
        """See `Runner.switch_to_cpu_kernels`: the forward's modules and the sampler switch together."""
        self.forward.switch_to_cpu_kernels()
        if self.forward.cpu_kernels is not None:
            self.sampler.kernel = self.forward.cpu_kernels

    def expert_load(self) -> dict[int, list[int]]:
        return self.forward.expert_load()

    def set_pooling(self, spec: PoolingSpec) -> None:
        self.forward.set_pooling(spec)

    def close(self) -> None:
        self.forward.close()
