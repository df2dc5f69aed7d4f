"""The forward of a step, behind one interface: `StepForward`, run by the model runner's pipeline
(engine/runner.py). Two implementations: `LocalForward` (engine/local_forward.py), the model and its caches in
this process, and `TensorParallelForward` (engine/tp_forward.py), which sends each step to worker processes whose
ranks each run a `LocalForward` on their shard (engine/tp_worker.py): the same forward code either way.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from mili_openai.engine.lora_manager import LoraManager
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.engine.pooling_spec import PoolingSpec
from mili_openai.engine.speculation import StepSpeculation
from mili_openai.engine.step_preparer import ForwardStep
from mili_openai.model import ModelConfig
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.rope import RotaryTable


class ForwardOutput(NamedTuple):
    """What `StepForward.run` gives a step."""

    # (T, hidden) after the final norm (pooling and model proposers read it); None: not in this process
    hidden: torch.Tensor | None
    logits: torch.Tensor | None  # (S, vocab) float32 of the rows to sample (`logits_indices`); None: none sampled
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] | None  # the scored prompt tokens', where any
    pooled: dict[int, np.ndarray] | None = None  # pooling chunks' reductions (engine/pooler.py), where any


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


class LoadedModel(Protocol):
    """What the engine reads of a loaded model, through its runner (`Runner`) or a runner's `StepForward`."""

    device: torch.device  # where the step's logits, and so its sampling, are
    model_config: ModelConfig
    quantization: str | None  # None, or what the weights are (for /v1/models)
    num_pages: int  # KV pages the engine may hand out
    num_state_slots: int  # state slots of the linear-attention layers (one per running sequence); 0 without any
    num_state_snapshots: int  # the prefix cache's state snapshots, slots numbered after those (0: none)
    state_slot_bytes: int  # bytes of one state slot (a snapshot's size); 0 without linear-attention layers
    failure: str | None  # why it can run no more steps; None while it can
    kernel_build: Future[bool] | None  # CPU kernels compiling meanwhile, to switch to once done; None: none
    lora: LoraManager | None  # the LoRA adapters' host copies and slots (`EngineConfig.lora`); None: LoRA off
    # whether a step's launch only queues work on the device (CUDA): the engine then launches on its loop thread,
    # a step ahead of the one finishing, and waits for each in `finish` on its worker thread; else `execute`
    # runs there (the forward computes where it is launched)
    async_launch: bool

    def switch_to_cpu_kernels(self) -> None:
        """Run on the kernels `kernel_build` built (on the forward thread, between steps, while no sequence runs)."""

    def expert_load(self) -> dict[int, list[int]]:
        """{sparse layer: (token, expert) pairs each expert received since load}; empty for a dense model."""

    def set_pooling(self, spec: PoolingSpec) -> None:
        """Serve a pooling model: pooling requests' chunks reduce to `spec`'s vectors (engine/pooler.py)."""


class StepForward(LoadedModel, Protocol):
    """Where a step's forward runs."""

    speculation: StepSpeculation | None  # its part of speculative decoding around a step (None: none)
    rotary_table: RotaryTable  # the model's RoPE cos/sin, which CPU steps build ahead on the loop thread
    cpu_kernels: Any  # the compiled CPU kernels the sampler may use (SamplingKernel); None: torch's ops

    def inputs(self, work: ForwardStep) -> ForwardBatch:
        """The step's inputs where `run` reads them (copied to the model's device; a tensor-parallel engine's stay
        on the host): the pending tokens are fed there."""

    def run(self, work: ForwardStep, batch: ForwardBatch) -> ForwardOutput:
        """The step's forward on `batch` (from `inputs`): its state slots reset, restored and saved around the
        model, prompt tokens scored, pooling chunks reduced, and the logits of its `num_sampled` rows."""

    def close(self) -> None:
        """Let what it holds outside this process go (a tensor-parallel forward's workers; also done when it is
        collected, and at interpreter exit)."""
