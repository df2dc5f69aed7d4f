"""Engine step period against a simulated GPU's step time, on CPU: does the host's work hide behind the GPU's?

Drives the real `AsyncEngine` and `EngineCore` (scheduler, step preparation with inputs staged as on CUDA,
postprocessing, the real Qwen3 tokenizer's incremental detokenizing, delivery to streams read by client
tasks) with a stand-in runner whose "GPU" is a stream thread: launching a step costs host time (small
torch ops that each release and retake the GIL, as a CUDA launch path's ops do, plus a GIL-free wait for
the graph launch), while its "kernels" run on the stream thread, which sleeps for the step's GPU time (the
GIL released), then writes the sampled ids and sets the step's event. With `async_launch` the step planned
ahead reads its pending input ids from the running step's ids on the stream, as on CUDA.

Prints, per batch size, simulated GPU time and engine mode, the median period between the ends of
consecutive full-batch decode steps, the simulated GPU's busy share, and the engine loop thread's CPU per
step. Left out: the CUDA driver's own CPU (a launch's GIL-free part is a sleep here, not spinning on a
core), a real GPU's copies, and torch's CUDA caching allocators; the sampler's and graph-fill ops are
stood in for by `--launch-ops` small CPU ops.

    .venv/bin/python scripts/engine_overlap.py                          # batch 64 at 3 ms, 256 at 8 ms
    .venv/bin/python scripts/engine_overlap.py --cases 64:3 --steps 200 --switch-intervals 0.005 0.0005
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from mili_openai.config import EngineConfig  # noqa: E402
from mili_openai.engine.async_engine import AsyncEngine  # noqa: E402
from mili_openai.engine.contract import check_request  # noqa: E402
from mili_openai.engine.core import EngineCore  # noqa: E402
from mili_openai.engine.sampler import SamplerOutput  # noqa: E402
from mili_openai.engine.sampling_params import SamplingParams  # noqa: E402
from mili_openai.engine.pending_tokens import LaunchedStep  # noqa: E402
from mili_openai.engine.step_preparer import StepPreparer  # noqa: E402
from mili_openai.model import ModelConfig  # noqa: E402
from mili_openai.model.default_model import default_model_path  # noqa: E402
from mili_openai.model.rope import RotaryEmbedding, RotaryTable  # noqa: E402

PAGE_SIZE = 16
PROMPT_TOKENS = 32
TOKEN_BASE, TOKEN_RANGE = 1000, 100_000  # sampled ids stay among ordinary vocabulary entries
GRAPH_LAUNCH_S = 0.67e-3  # host time of one decode graph's launch (cudaGraphLaunch) in the H100 profile
LAUNCH_OPS = 35  # torch calls on a CUDA decode step's launch path (input copy, feed, graph fill, logits, sampler)


class SimulatedStream:
    """A GPU stream stand-in: runs queued callables one after another on its own thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.step_ends: list[tuple[float, int]] = []  # (time a step's kernels ended, its sampled rows)
        self._thread = threading.Thread(target=self._run, name="simulated-gpu", daemon=True)
        self._thread.start()

    def enqueue(self, work) -> None:
        self._queue.put(work)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work()


@dataclasses.dataclass(slots=True)
class SimulatedSample:
    token_ids: np.ndarray  # written by the stream when the step's kernels have run
    done: threading.Event


class SimulatedRunner:
    """A `Runner` (engine/runner.py) whose forward and sampling are a wait on `SimulatedStream`."""

    quantization = None
    failure = None
    kernel_build = None
    lora = None
    num_state_slots = num_state_snapshots = state_slot_bytes = 0  # an attention-only model

    def __init__(self, config: EngineConfig, model_path: Path, stream: SimulatedStream, gpu_s: float,
                 launch_ops: int, graph_launch_s: float) -> None:
        self.device = torch.device("cpu")
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.num_pages = config.num_pages
        self.async_launch = bool(config.async_launch)
        # prepared as for CUDA (inputs staged in one buffer, no rotary on the host); unpinned: no CUDA here
        self.preparer = StepPreparer(torch.device("cuda"), config.page_size,
                                     RotaryTable(RotaryEmbedding(self.model_config), torch.float32), pin_memory=False)
        self._previous = LaunchedStep.nothing_sampled()  # the step launched last, whose ids the next one reads
        self.stream, self.gpu_s, self.launch_ops, self.graph_launch_s = stream, gpu_s, launch_ops, graph_launch_s
        self._scratch = torch.zeros(64)

    def switch_to_cpu_kernels(self) -> None:
        """Nothing to switch."""

    def expert_load(self) -> dict[int, list[int]]:
        return {}

    def prepare(self, batch, sample_index=None):
        return self.preparer.prepare(batch, sample_index)

    def execute(self, step) -> SamplerOutput:
        return self.finish(self.launch(step))

    def launch(self, step) -> LaunchedStep:
        """As `ModelRunner.launch`, with the pending ids gathered on the stream (`PendingTokens.feed`'s device
        path), behind the step before's kernels."""
        input_ids = step.forward.batch.input_ids.numpy().copy()  # the input copy, as queued now
        logits_rows = step.forward.batch.logits_indices.numpy().copy()
        pending, previous = step.pending, self._previous
        if pending is not None and step.needs_host_tokens and previous.output is None:
            raise RuntimeError("this step needs the tokens of the step before on the host: finish that one first")
        for _ in range(self.launch_ops):  # each releases and retakes the GIL, as a CUDA op's launch does
            self._scratch.add_(1)
        time.sleep(self.graph_launch_s)  # the graph launch: host time with the GIL released
        sample = SimulatedSample(np.empty(len(step.rows), dtype=np.int64), threading.Event())
        stream, gpu_s = self.stream, self.gpu_s

        def kernels() -> None:
            if pending is not None:  # the pending input ids, from the step before's sampled ids "on the device"
                input_ids[pending.rows] = previous.token_ids.numpy()[pending.sources]
            time.sleep(gpu_s)
            sample.token_ids[:] = (input_ids[logits_rows] * 7919 + 13) % TOKEN_RANGE + TOKEN_BASE
            stream.step_ends.append((time.perf_counter(), len(logits_rows)))
            sample.done.set()

        self.stream.enqueue(kernels)
        self._previous = LaunchedStep(sampled=sample, token_ids=torch.from_numpy(sample.token_ids))
        return self._previous

    @staticmethod
    def finish(launched: LaunchedStep) -> SamplerOutput:
        launched.sampled.done.wait()  # the event's wait, the GIL released
        token_ids = launched.sampled.token_ids.tolist()
        launched.output = SamplerOutput(token_ids=token_ids, logprobs=[None] * len(token_ids))
        return launched.output


def run_case(model_path: Path, tokenizer, batch: int, gpu_s: float, steps: int, async_launch: bool,
             switch_interval_s: float, launch_ops: int, graph_launch_s: float) -> dict[str, float]:
    pages_per_seq = -(-(PROMPT_TOKENS + steps) // PAGE_SIZE)
    config = EngineConfig(model=str(model_path), device="cpu", page_size=PAGE_SIZE, num_pages=batch * pages_per_seq,
                          max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=PROMPT_TOKENS + steps + 1,
                          async_launch=async_launch, switch_interval_s=switch_interval_s)
    stream = SimulatedStream()

    def core_factory(config: EngineConfig, observer) -> EngineCore:
        runner = SimulatedRunner(config, model_path, stream, gpu_s, launch_ops, graph_launch_s)
        return EngineCore(config, runner, tokenizer, observer)

    engine = AsyncEngine(config, core_factory=core_factory)
    rng = np.random.default_rng(0)
    prompts = [(rng.integers(0, TOKEN_RANGE, PROMPT_TOKENS) + TOKEN_BASE).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)

    async def consume(stream_) -> int:
        return sum([len(delta.token_ids) async for delta in stream_])

    async def main() -> float:
        await engine.start()
        cpu_start = time.thread_time()
        try:
            streams = [await engine.submit(check_request(p, params, engine.info)) for p in prompts]
            counts = await asyncio.gather(*(consume(stream) for stream in streams))
        finally:
            await engine.shutdown()
            await engine.close()
        if sum(counts) != batch * steps:
            raise RuntimeError(f"expected {batch * steps} tokens, got {sum(counts)}")
        return time.thread_time() - cpu_start

    previous_interval = sys.getswitchinterval()
    try:
        loop_cpu = asyncio.run(main())
    finally:
        sys.setswitchinterval(previous_interval)
        stream.close()
    full = [end for end, rows in stream.step_ends if rows == batch]
    periods = np.diff(full)
    period = float(statistics.median(periods))
    return {"period_ms": period * 1e3, "gpu_busy": gpu_s / period,
            "loop_cpu_ms": loop_cpu / len(stream.step_ends) * 1e3}


def parse_case(text: str) -> tuple[int, float]:
    batch, gpu_ms = text.split(":")
    return int(batch), float(gpu_ms) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=[(64, 3e-3), (256, 8e-3)],
                        metavar="BATCH:GPU_MS", help="batch size and simulated GPU time per step")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, taking turns")
    parser.add_argument("--switch-intervals", nargs="+", type=float, default=[0.005, 0.0005])
    parser.add_argument("--launch-ops", type=int, default=LAUNCH_OPS)
    parser.add_argument("--graph-launch-ms", type=float, default=GRAPH_LAUNCH_S * 1e3)
    args = parser.parse_args()
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; median of {args.rounds} runs each")
    print(f"{'batch':>5} {'gpu ms':>6} {'mode':>12} {'switch s':>8} {'period ms':>9} {'gpu busy':>8} "
          f"{'loop cpu ms/step':>16}")
    for batch, gpu_s in args.cases:
        variants = [(mode, interval) for mode in (False, True) for interval in args.switch_intervals]
        results = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant in variants:
                results[variant].append(run_case(model_path, tokenizer, batch, gpu_s, args.steps, *variant,
                                                 args.launch_ops, args.graph_launch_ms / 1e3))
        for (mode, interval), runs in results.items():
            med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            spread = max(run["period_ms"] for run in runs) - min(run["period_ms"] for run in runs)
            print(f"{batch:>5} {gpu_s * 1e3:>6.1f} {'async launch' if mode else 'worker':>12} {interval:>8} "
                  f"{med['period_ms']:>6.2f}±{spread / 2:<4.2f} {med['gpu_busy']:>7.0%} {med['loop_cpu_ms']:>16.2f}")


if __name__ == "__main__":
    main()
