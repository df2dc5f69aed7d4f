"""The asyncio engine: one loop owns all engine state; the forward runs on one worker thread.

It is the server's `EngineClient` (engine/client.py): `submit` queues a checked request of n samples (its
structured-output format compiled on a worker thread first) and returns the `RequestStream` of their deltas;
`abort` frees what it holds.
The loop is schedule -> prepare -> (worker thread) forward + sample -> postprocess -> deliver. While a
step runs, the loop plans the next one where it can (`EngineCore.schedule_ahead`) and queues it on the
worker, which starts it the moment the running step ends: the loop's own work for a step (postprocess,
schedule, prepare, waking the worker) then overlaps the forward instead of sitting between two.

Where the runner's launch only queues work on a device (`Runner.async_launch`, CUDA), the loop launches
each step itself and the worker only waits for its results (`Runner.finish`): the step planned ahead is
queued on the GPU behind the running one, its pending input ids read from the running step's sampled ids
on the device, so the GPU starts it the moment the running one ends, whatever the host is doing. A step
that needs the step before's tokens on the host (`PreparedStep.needs_host_tokens`) runs whole on the
worker after that step's finish, as do the steps planned behind it until the pipeline drains.

The loop thread's own torch ops stay on that thread (`serial_torch_ops`), so the forward's OpenMP team
stays fast. The loop runs a few torch ops per step (batch metadata, rotary cos/sin). Above ATen's grain
size (32768 elements) such an op runs in parallel, and OpenMP gives the loop thread a team of its own.
libgomp then manages more threads than there are cores, and from that moment cuts the spinning at every
barrier of every team to ~100 turns: the forward's two threads sleep and wake at each of the hundreds of
parallel regions in a step, which slows every decode step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from threadpoolctl import threadpool_limits

from mili_openai.config import EngineConfig
from mili_openai.engine.client import DeltaSink, RequestStream
from mili_openai.engine.contract import EngineRequest
from mili_openai.engine.core import EngineCore
from mili_openai.engine.outputs import EngineObserver, EngineStats, PageAccounting, ProfileFiles, SequenceDelta
from mili_openai.engine.parallel_sampling import ParentRequest
from mili_openai.engine.step_preparer import PreparedStep
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.step_profiler import StepProfiler

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how long the loop waits when it has work that cannot be scheduled yet


@contextlib.contextmanager
def serial_torch_ops() -> Iterator[None]:
    """Torch ops on the calling thread run on it alone while inside; other threads keep their teams.

    OpenMP's thread count is per thread (`omp_set_num_threads` sets the calling thread's), which is
    what threadpoolctl sets for "openmp"; BLAS pools, which are process-wide, are left alone.
    """
    # torch sets a thread's OpenMP count on that thread's first parallel-capable op: let it happen
    # now, or it would later undo the limit below
    torch.get_num_threads()
    with threadpool_limits(limits=1, user_api="openmp"):
        yield


@dataclass(frozen=True, slots=True)
class InFlightStep:
    batch: ScheduledBatch
    future: concurrent.futures.Future  # the worker's forward + sampling of the batch, or its finish
    launched: bool  # launched on the loop: the worker only finishes it (Runner.async_launch)


CoreFactory = Callable[[EngineConfig, EngineObserver | None], EngineCore]


class AsyncEngine:
    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None,
                 core_factory: CoreFactory = EngineCore.from_config) -> None:
        """core_factory: builds the core (its model runner) from the config; a stand-in runner's core in
        scripts/engine_overlap.py."""
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mili-forward")
        # Load on the thread that will run every forward: torch's OpenMP pool belongs to the thread that
        # first runs parallel work, and a second pool left behind by a loader thread slows every step.
        try:
            self.core = self._executor.submit(core_factory, config, observer).result()
        except BaseException:
            self._executor.shutdown(wait=False)  # no engine: do not leave its worker thread behind
            raise
        self.core.grammars.load_vocabulary()
        self.info = self.core.info
        self._streams: dict[str, DeltaSink] = {}  # by request id, until the delta that finishes the request
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop_error: str | None = None  # why the loop stopped, where a bug stopped it
        # steps handed to the worker, oldest first: the one running and at most one queued behind it
        self._launched: deque[InFlightStep] = deque()
        # `--torch-profiler-dir`: profiles of the steps, started and stopped on request (engine/step_profiler.py)
        self._profiler = (StepProfiler(config.torch_profiler_dir, self.core.runner.device)
                          if config.torch_profiler_dir is not None else None)

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._loop_task is not None:
            return
        if self.config.switch_interval_s is not None:  # the process's: this engine is what it runs
            sys.setswitchinterval(self.config.switch_interval_s)
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="mili-engine-loop")
        build = self.core.runner.kernel_build
        if build is not None:  # the loop switches to the kernels once they are built and it is idle
            loop = asyncio.get_running_loop()
            build.add_done_callback(lambda _: loop.call_soon_threadsafe(self._wake))

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def is_ready(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel worker died, or a bug stopped the loop), or None. The server exits
        non-zero when this is set (server/drain.py)."""
        return self.core.runner.failure or self._loop_error

    async def shutdown(self) -> None:
        """Stop the loop and abort every request; the model stays loaded and `start` may run again."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._launched:
            # the worker may still be writing K/V into pages the aborts below release
            await asyncio.to_thread(concurrent.futures.wait, [step.future for step in self._launched])
            self._launched.clear()
        for request_id in list(self._streams):
            self.abort(request_id)
        self._wakeup = None
        if self._profiler is not None:
            self._profiler.discard()

    async def close(self) -> None:
        """Let the forward thread go (after `shutdown`); the model stays loaded until the engine is dropped."""
        self._executor.shutdown(wait=False)

    # ---- requests ----
    async def submit(self, request: EngineRequest, request_id: str | None = None) -> RequestStream:
        await self.compile_format(request.params)
        parent = self._add(request, request_id)
        stream = RequestStream(parent.request_id, parent.num_samples, self.abort)
        self._streams[parent.request_id] = stream
        return stream

    def submit_to(self, sink: DeltaSink, request: EngineRequest, request_id: str) -> None:
        """As `submit`, its format compiled already, with the deltas put into `sink` rather than a new stream (an
        engine process's outbox, engine/engine_process.py)."""
        self._add(request, request_id)
        self._streams[request_id] = sink

    async def compile_format(self, params: SamplingParams) -> None:
        """Compile the request's structured-output format, if any, on a worker thread (ValueError if it is
        bad): adding the request then finds it compiled and only copies it, instead of the event loop stalling
        every stream for the compile."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.core.grammars.compile, params.structured_outputs)

    def _add(self, request: EngineRequest, request_id: str | None) -> ParentRequest:
        if self._wakeup is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        parent = self.core.add(request, request_id)
        self._wakeup.set()
        return parent

    def abort(self, request_id: str) -> None:
        for delta in self.core.abort(request_id):
            self._deliver(delta)

    def abort_all(self) -> int:
        """Abort every live request (a shutdown past its grace); returns how many were aborted."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        return self.core.lora.served_adapters()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` from now (EngineClient.load_lora_adapter)."""
        registry = self.core.lora
        registry.begin_load(name)
        adapter = None
        try:  # read on the forward thread, between steps: its torch ops stay off the loop's (serial_torch_ops)
            adapter = await asyncio.wrap_future(self._executor.submit(registry.read, name, path))
        finally:
            registry.finish_load(name, path, adapter)

    async def unload_lora_adapter(self, name: str) -> None:
        """New requests may no longer name it; those that do already finish on it (EngineClient)."""
        self.core.lora.unload(name, self.core.sequences.values())

    async def page_accounting(self) -> PageAccounting:
        """A snapshot of the page pool and an integrity check (walks the tree: for debugging, not per request)."""
        core = self.core
        try:
            core.check_integrity()
            error = None
        except RuntimeError as exc:  # the tree reports what is inconsistent
            error = f"{type(exc).__name__}: {exc}"
        pool, tree = core.pages.pool, core.pages.tree
        return PageAccounting(
            num_pages=pool.num_pages, num_free=pool.num_free, num_cached=tree.cached_pages,
            num_locked=tree.locked_pages, num_owned=sum(len(s.owned_pages) for s in core.sequences.values()),
            num_sequences=len(core.sequences), integrity_error=error,
        )

    def set_observer(self, observer: EngineObserver | None) -> None:
        """Attach the server's metrics to an engine built before the server (one observer at a time)."""
        self.core.observer = observer

    async def start_profile(self) -> None:
        """Start a torch profile of the steps, here on the loop's thread (ProfilerStateError if one runs)."""
        self._step_profiler().start()

    async def stop_profile(self) -> ProfileFiles:
        """Stop the running profile (ProfilerStateError if none) and write its files, off the loop."""
        stopped = self._step_profiler().stop()
        return await asyncio.to_thread(stopped.write)

    def _step_profiler(self) -> StepProfiler:
        if self._profiler is None:
            raise ValueError("profiling is off: start the engine with a torch_profiler_dir (--torch-profiler-dir)")
        return self._profiler

    # ---- the loop ----
    def _deliver(self, delta: SequenceDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        stream.put(delta)
        if delta.request_finished:
            del self._streams[delta.request_id]

    async def _run(self) -> None:
        with serial_torch_ops():  # see the module docstring: a parallel op here slows every forward after it
            try:
                await self._loop()
            except Exception as exc:  # a bug: fail the requests rather than hang them, and the server exits
                logger.exception("the engine loop stopped")
                self._loop_error = f"the engine loop stopped: {exc!r}"
                self._fail_everything(self._loop_error)

    async def _loop(self) -> None:
        launched = self._launched
        while True:
            if not launched:
                if not self.core.has_work():
                    build = self.core.runner.kernel_build
                    if build is not None and build.done():  # idle, with no step in flight: switch now
                        await self._switch_to_cpu_kernels()
                        continue
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                scheduled = self.core.schedule()
                if scheduled is None:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                launched.append(self._launch(*scheduled))
            if len(launched) == 1:
                ahead = self.core.schedule_ahead(launched[0].batch)
                if ahead is not None:
                    launched.append(self._launch(*ahead))
            step = launched[0]
            try:
                output = await asyncio.wrap_future(step.future)
            except Exception as exc:  # a failed forward fails its batch, not the server
                launched.popleft()
                if self.fatal_error is not None:  # ... unless the runner cannot go on: then it fails everything
                    self._fail_everything(self.fatal_error)
                    return
                logger.exception("forward failed; aborting the requests of its %d sequences", len(step.batch.seqs))
                for seq in step.batch.seqs:
                    seq.error = f"engine error: {exc}"
                for seq in step.batch.seqs:
                    self.abort(seq.parent_id)
                continue
            launched.popleft()  # not on cancellation: shutdown waits for every step still on the worker
            postprocess = self.core.postprocess
            if self._profiler is not None:
                postprocess = self._profiler.recorded(postprocess, "postprocess")
                self._profiler.on_step()
            for delta in postprocess(step.batch, output):
                self._deliver(delta)

    async def _switch_to_cpu_kernels(self) -> None:
        try:
            await asyncio.wrap_future(self._executor.submit(self.core.runner.switch_to_cpu_kernels))
        except Exception:  # a failed switch leaves torch's ops serving
            logger.exception("could not switch to the compiled CPU kernels; torch's ops keep serving")

    def _fail_everything(self, reason: str) -> None:
        logger.error("the engine stopped (%s); failing its %d request(s)", reason.splitlines()[0], len(self._streams))
        for seq in self.core.sequences.values():
            seq.error = f"engine error: {reason.splitlines()[0]}"
        for request_id in list(self._streams):
            self.abort(request_id)

    def _launch(self, batch: ScheduledBatch, step: PreparedStep) -> InFlightStep:
        """Hand the step to the worker; or, where the runner launches asynchronously, launch it here (behind
        the step in flight, which must have been launched here too) and hand the worker its finish."""
        runner = self.core.runner
        execute, launch, finish = runner.execute, runner.launch, runner.finish
        if self._profiler is not None:  # named ranges in the trace while a profile runs
            profiler = self._profiler
            execute = profiler.recorded(execute, "execute")
            launch, finish = profiler.recorded(launch, "launch"), profiler.recorded(finish, "finish")
        if not runner.async_launch or step.needs_host_tokens or not all(s.launched for s in self._launched):
            return InFlightStep(batch, self._executor.submit(execute, step), launched=False)
        try:
            launched = launch(step)
        except Exception as exc:  # fails its batch, as a failed forward on the worker does
            failed = concurrent.futures.Future()
            failed.set_exception(exc)
            return InFlightStep(batch, failed, launched=True)
        return InFlightStep(batch, self._executor.submit(finish, launched), launched=True)
