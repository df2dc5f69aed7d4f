"""Tensor parallelism from the engine's side: `TensorParallelForward` is the runner's `StepForward` when
`tensor_parallel_size` > 1, with the forward moved to N worker processes (engine/tp_worker.py), each running a
`LocalForward` on its shard.

The engine process keeps everything else as with one device: the scheduler, the radix tree and the page
table (which every rank shares, as the slots in each step's inputs), the model runner's pipeline (building each
step's inputs, feeding the tokens the step before sampled, on the host here), and the sampler with each
request's generator and grammar state. Only the forward and the logits run in the workers.

Each step's inputs (its `ForwardStep`) are encoded once and written to every worker's pipe, rather than broadcast
by a collective from a rank living in the engine: an idle worker then blocks in a pipe read (not in a
collective, which times out under gloo and spins under NCCL), the engine process is never inside a
collective itself, so a dead worker cannot hang it, and the payload is kilobytes.

A dead rank: the engine waits for rank 0's reply together with every worker's pipe and process sentinel,
and a watcher thread waits on the sentinels between steps. A worker that dies or reports an error stops
them all, one log line names the rank, its pid and how it ended, `failure` is set and the step raises
`RunnerFailed`; the server then exits non-zero (engine/async_engine.py, server/drain.py).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import weakref
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from mili_openai.config import EngineConfig
from mili_openai.engine.process_helpers import describe_exit
from mili_openai.engine.step_forward import ForwardOutput, resolve_device
from mili_openai.engine.step_preparer import ForwardStep
from mili_openai.engine.tp_lora import TensorParallelLora
from mili_openai.engine.tp_worker import (
    REPLYING_RANK,
    ExpertLoadReply,
    ExpertLoadRequest,
    Shutdown,
    StepReply,
    TensorParallelStep,
    WorkerFailed,
    WorkerReady,
    decode,
    encode,
    worker_main,
)
from mili_openai.kernels import load_cpu_kernels
from mili_openai.kernels.planning import KernelPlan
from mili_openai.model import ModelConfig, resolve_dtype
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.quantization.spec import read_checkpoint_quantization
from mili_openai.model.rope import RotaryEmbedding, RotaryTable
from mili_openai.model.tensor_parallel import check_tensor_parallel

logger = logging.getLogger(__name__)

# The workers are forked from multiprocessing's fork server, which imports these modules (torch, the model code) once
# per process: spawned, every rank imported them anew (~2 s of CPU each, at every start of every group). The fork
# server runs no torch op, so no OpenMP pool or CUDA context is forked. It keeps the environment it started with.
WORKER_START_METHOD = "forkserver"
WORKER_PRELOAD = ["mili_openai.engine.tp_worker"]
SHUTDOWN_TIMEOUT_S = 10.0  # a worker asked to stop gets this long before it is terminated
KILL_TIMEOUT_S = 5.0  # then this long after SIGTERM before SIGKILL


class RunnerFailed(RuntimeError):
    """The runner can run no more steps (a tensor-parallel worker died or failed): the engine must stop."""


def _stop_processes(processes: list, conns: list[Connection], rendezvous: str, stopping: threading.Event,
                    graceful: bool) -> None:
    """Ask each worker to exit (graceful), then terminate and kill whatever is left; remove the rendezvous.
    `stopping` is set first, so the watcher takes these exits for what they are."""
    stopping.set()
    if graceful:
        for conn in conns:
            try:
                conn.send_bytes(encode(Shutdown()))
            except OSError:  # that worker is gone already
                pass
        for process in processes:
            process.join(SHUTDOWN_TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(KILL_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(rendezvous, ignore_errors=True)


class WorkerGroup:
    """N spawned workers, one pipe each, and the watch over them."""

    def __init__(self, config: EngineConfig, model_path: Path, size: int, kernel_plan: KernelPlan | None) -> None:
        """`kernel_plan`: the CPU kernels' plan the workers adopt rather than each timing its own."""
        context = torch.multiprocessing.get_context(WORKER_START_METHOD)
        context.set_forkserver_preload(WORKER_PRELOAD)  # read when the fork server starts: once per process
        self._rendezvous = tempfile.mkdtemp(prefix="mili-tp-")
        init_method = f"file://{self._rendezvous}/store"  # a file rendezvous: no port to race for
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopping = threading.Event()
        self.failure: str | None = None
        self._processes = []
        self._conns: list[Connection] = []
        log_level = logging.getLogger().getEffectiveLevel()
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, name=f"mili-tp-rank-{rank}", daemon=True,
                                      args=(rank, size, config, str(model_path), init_method, theirs, log_level,
                                            kernel_plan))
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_processes, self._processes, self._conns, self._rendezvous,
                                           self._stopping, True)
        self.ready: list[WorkerReady | None] = [None] * size
        while not all(self.ready):
            rank, message = self._next_message()
            if isinstance(message, WorkerReady):
                self.ready[rank] = message
                logger.info("tensor-parallel rank %d of %d ready (pid %d)", rank, size, message.pid)
        self._watcher = threading.Thread(target=self._watch, name="mili-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by rank."""
        return [process.pid for process in self._processes]

    def request(self, message: Any, reply_type: type) -> Any:
        """Send `message` to every worker; -> rank 0's reply. Raises RunnerFailed if any worker dies or fails."""
        if self.failure is not None:
            self._fail(self.failure)
        data = encode(message)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(self._death(rank))
        while True:
            rank, reply = self._next_message()
            if rank == REPLYING_RANK and isinstance(reply, reply_type):
                return reply

    def stop(self, graceful: bool = True) -> None:
        """Stop every worker; returns once they are gone (also when another thread is stopping them)."""
        with self._stop_lock:
            if self._finalizer.detach() is not None:  # not stopped already
                _stop_processes(self._processes, self._conns, self._rendezvous, self._stopping, graceful)

    def _next_message(self) -> tuple[int, Any]:
        """The next message any worker sends, as (rank, message); a worker's error or death raises RunnerFailed.
        A worker's pipe is read before its death is concluded: its last words (an error) come first."""
        ranks: dict[Any, int] = {conn: rank for rank, conn in enumerate(self._conns)}
        ranks.update({process.sentinel: rank for rank, process in enumerate(self._processes)})
        while True:
            if self.failure is not None:
                self._fail(self.failure)
            try:
                ready = connection.wait(list(ranks))
            except OSError:  # the watcher stopped the group and closed the pipes meanwhile
                raise RunnerFailed(self.failure or "the tensor-parallel workers were stopped") from None
            pipes = [item for item in ready if isinstance(item, Connection)]
            for pipe in pipes:
                rank = ranks[pipe]
                try:
                    message = decode(pipe.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death(rank))
                if isinstance(message, WorkerFailed):
                    self._fail(f"tensor-parallel rank {rank} failed:\n{message.error.rstrip()}")
                return rank, message
            for item in ready:  # only sentinels are left: a worker exited without a word
                self._fail(self._death(ranks[item]))

    def _death(self, rank: int) -> str:
        process = self._processes[rank]
        with self._reap_lock:  # one waitpid at a time: the thread that lost a race would read no exit code
            process.join(KILL_TIMEOUT_S)
            code = process.exitcode
        return f"tensor-parallel rank {rank} (pid {process.pid}) {describe_exit(code, 'closed its pipe')}"

    def _fail(self, reason: str) -> None:
        self._mark_failed(reason)
        self.stop(graceful=False)  # where the watcher is stopping them, wait until it has
        raise RunnerFailed(self.failure)

    def _mark_failed(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._stopping.is_set():
                return
            self.failure = reason
        logger.error("%s; stopping every rank: the engine cannot continue", reason)
        self.stop(graceful=False)

    def _watch(self) -> None:
        """Between steps nobody reads the pipes: notice a worker's death here, within the moment."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        ready = connection.wait(list(sentinels))
        if not self._stopping.is_set():
            self._mark_failed(self._death(sentinels[ready[0]]))


class TensorParallelForward:
    """A `StepForward` (engine/step_forward.py) whose model lives in `tensor_parallel_size` worker processes (see
    the module doc): this process loads no weights and holds no KV cache."""

    kernel_build = None  # the workers load with the CPU kernels built: nothing to switch to later
    speculation = None  # verifying drafts needs no runner's part here: no linear-attention state to roll back
    async_launch = False  # a step's forward is a round trip to the workers: `run` waits for their logits

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        size = config.tensor_parallel_size
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees "
                             f"{torch.cuda.device_count()}")
        self.model_config = ModelConfig.from_pretrained(model_path)
        check_tensor_parallel(self.model_config, size)
        if config.quantization is not None or read_checkpoint_quantization(model_path) is not None:
            raise ValueError("quantized weights run on one rank: not with tensor_parallel_size > 1 yet")
        if self.model_config.hybrid is not None and config.speculative_config is not None:
            raise ValueError("speculative decoding on a model with linear-attention layers runs on one rank: the "
                             "workers do not roll states back to the last kept draft (not with "
                             "tensor_parallel_size > 1 yet)")
        self.quantization = None  # what /v1/models reports
        # LoRA: every rank serves its share of each adapter; this process checks them and sends the changes
        self.lora = TensorParallelLora(config.lora, self.model_config) if config.lora is not None else None
        dtype = resolve_dtype(config.dtype)
        self.cpu_kernels = cpu_kernels = load_cpu_kernels(config.kernel_plan_cache) if self.device.type == "cpu" else None
        threads = config.num_threads
        if threads is None and self.device.type == "cpu":  # the cores shared out between the workers
            threads = max(1, torch.get_num_threads() // size)
        worker_config = dataclasses.replace(config, device=self.device.type, num_threads=threads)
        self.workers = WorkerGroup(worker_config, model_path, size,
                                   cpu_kernels.plan if cpu_kernels is not None else None)
        ready = self.workers.ready[0]  # the ranks size the KV pool (each its own memory) and agree on it
        self.num_pages = ready.num_pages
        self.num_state_slots = ready.num_state_slots
        # every rank snapshots its own heads' states in slots numbered alike: a snapshot's memory is all ranks'
        self.num_state_snapshots = ready.num_state_snapshots
        self.state_slot_bytes = sum(rank.state_slot_bytes for rank in self.workers.ready)
        self.rotary_table = RotaryTable(RotaryEmbedding(self.model_config), dtype)

    @property
    def failure(self) -> str | None:
        return self.workers.failure

    def close(self) -> None:
        """Stop the workers (also done when the runner is collected, and at interpreter exit)."""
        self.workers.stop()

    def expert_load(self) -> dict[int, list[int]]:
        return self.workers.request(ExpertLoadRequest(), ExpertLoadReply).expert_load

    def set_pooling(self, spec) -> None:
        raise ValueError("pooling models (embeddings, reranking) run on one rank: not with --tensor-parallel-size > 1")

    def switch_to_cpu_kernels(self) -> None:
        """Nothing to switch: see `kernel_build`."""

    def inputs(self, work: ForwardStep) -> ForwardBatch:
        return work.batch  # the workers read the input ids this process sends: they stay on the host

    def run(self, work: ForwardStep, batch: ForwardBatch) -> ForwardOutput:
        """Send the step to every worker; -> rank 0's logits on this process's device, for its sampler."""
        # the pinned staging buffer stays here: each rank copies the batch's own tensors
        step = TensorParallelStep(dataclasses.replace(work, batch=batch, staged=None),
                                  self.lora.take_updates() if self.lora is not None else [])
        reply: StepReply = self.workers.request(step, StepReply)
        logits = reply.logits.to(self.device) if reply.logits is not None else None
        return ForwardOutput(hidden=None, logits=logits, prompt_logprobs=reply.prompt_logprobs)
