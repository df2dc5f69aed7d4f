"""A tensor-parallel worker process: one rank's shard of the model and of the KV cache, running the steps the
engine process sends it.

The engine writes each step (the `ForwardStep` it built, with every rank's page table the same, and any LoRA
adapter changes) once, as one encoded message, to every worker's pipe. All ranks run the forward, the same code as with one process
(`LocalForward.run`), whose collectives (model/qwen3.py) meet over torch.distributed, and the logits of the
sampled rows, gathered from the vocabulary shards; rank 0 alone replies, with those logits and any prompt
log-probabilities, and the engine samples. A rank that fails replies with its traceback and exits; the engine
stops them all.

Messages are pickled with tensors as raw bytes (`encode`), not through torch.multiprocessing's shared
memory reductions: a step's inputs are kilobytes, and a shared-memory segment per tensor per step would
cost more than the copy.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mili_openai.config import EngineConfig
from mili_openai.distributed import init_tensor_parallel
from mili_openai.engine.local_forward import LocalForward
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.engine.process_helpers import exit_with_parent
from mili_openai.engine.step_forward import resolve_device
from mili_openai.engine.step_preparer import ForwardStep
from mili_openai.engine.tp_lora import LoraUpdate
from mili_openai.kernels.cpu import adopt_cpu_kernel_plan
from mili_openai.kernels.planning import KernelPlan

logger = logging.getLogger(__name__)

REPLYING_RANK = 0
WORKER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s"


# ---- messages (engine -> workers: TensorParallelStep, ExpertLoadRequest, Shutdown; workers -> engine: the rest) ----
@dataclass(slots=True)
class TensorParallelStep:
    """A step for every rank: the forward's inputs, and the LoRA adapters loaded or unloaded since the step before
    (engine/tp_lora.py), applied before the forward."""

    work: ForwardStep
    lora_updates: list[LoraUpdate] = field(default_factory=list)


@dataclass(slots=True)
class StepReply:
    logits: torch.Tensor | None  # (num_sampled, vocab) float32 on the CPU
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] | None


@dataclass(frozen=True, slots=True)
class ExpertLoadRequest:
    pass


@dataclass(frozen=True, slots=True)
class ExpertLoadReply:
    expert_load: dict[int, list[int]]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class WorkerReady:
    rank: int
    pid: int
    num_pages: int  # of the KV pool, the same on every rank (the fewest any rank had room for)
    num_state_slots: int  # of the linear-attention layers' state pool (Runner.num_state_slots)
    num_state_snapshots: int  # the prefix cache's snapshots past those (the fewest any rank had room for)
    state_slot_bytes: int  # one slot's memory on this rank (its heads' share)


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    rank: int
    error: str  # the traceback


def _tensor_from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(raw).view(dtype).reshape(shape)


class _WirePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):  # any dtype (bf16 has no numpy twin): its bytes, rebuilt by view
            # (an empty tensor's flat view may have stride 0, which a byte view refuses: it has no bytes anyway)
            flat = obj.detach().to("cpu").contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
            return _tensor_from_bytes, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def encode(message: Any) -> bytes:
    buffer = io.BytesIO()
    _WirePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    return pickle.loads(data)


# ---- the worker ----
@torch.inference_mode()
def run_step(forward: LocalForward, step: TensorParallelStep) -> StepReply:
    """One step on this rank's shard, its logits brought to the host for the engine to sample from."""
    for update in step.lora_updates:  # each rank reads a loaded adapter's share itself
        if update.path is None:
            forward.lora.remove(update.adapter_id)
        else:
            forward.lora.add(update.adapter_id, update.name, update.path, forward.lora.read(update.name, update.path))
    out = forward.run(step.work, forward.inputs(step.work))
    logits = out.logits.cpu() if out.logits is not None else None  # (S, vocab)
    return StepReply(logits=logits, prompt_logprobs=out.prompt_logprobs)


def _handle(forward: LocalForward, message: Any) -> Any:
    if isinstance(message, TensorParallelStep):
        return run_step(forward, message)
    if isinstance(message, ExpertLoadRequest):  # every rank routes alike: rank 0's counts are the model's
        return ExpertLoadReply(forward.expert_load())
    raise TypeError(f"a tensor-parallel worker got an unknown message {type(message).__name__}")


def worker_main(rank: int, size: int, config: EngineConfig, model_path: str, init_method: str, conn: Connection,
                log_level: int, kernel_plan: KernelPlan | None) -> None:
    """The worker process: join the group, load the shard, then serve the engine's messages until Shutdown
    or until the engine's end of the pipe closes."""
    logging.basicConfig(level=log_level, format=WORKER_LOG_FORMAT.format(rank=rank))
    exit_with_parent()
    try:
        if kernel_plan is not None:
            adopt_cpu_kernel_plan(kernel_plan)
        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank)
        group = init_tensor_parallel(rank, size, device, init_method)
        forward = LocalForward(config, Path(model_path), parallel=group)
    except BaseException:
        conn.send_bytes(encode(WorkerFailed(rank, traceback.format_exc())))
        return
    conn.send_bytes(encode(WorkerReady(rank, os.getpid(), forward.num_pages, forward.num_state_slots,
                                       forward.num_state_snapshots, forward.state_slot_bytes)))
    try:
        _serve(forward, conn, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(forward: LocalForward, conn: Connection, rank: int) -> None:
    while True:
        try:
            message = decode(conn.recv_bytes())
        except EOFError:  # the engine is gone
            return
        if isinstance(message, Shutdown):
            return
        try:
            reply = _handle(forward, message)
        except Exception:
            logger.exception("tensor-parallel rank %d failed", rank)
            conn.send_bytes(encode(WorkerFailed(rank, traceback.format_exc())))
            return
        if rank == REPLYING_RANK:
            conn.send_bytes(encode(reply))
