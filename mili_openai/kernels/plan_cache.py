"""The kernel plan (kernels/planning.py) kept on disk, so that a process starting on a machine that already timed
one reads it back instead of timing it again (seconds at every start; vLLM and Triton keep their autotuning
results the same way).

A plan holds for one machine, one build of the kernels and one planner: its file's name is a hash of the CPU
(model name and flags), the torch version, the intra-op threads (the timings run on them), the kernels' build
(its name hashes every source) and the planner's source (its calibration shapes and choices). Anything else in
the directory, or a file that does not read back as a plan, is timed anew and written over. The directory is the
kernels' build directory (TORCH_EXTENSIONS_DIR's cache volume in the Docker image). EngineConfig.kernel_plan_cache
(`--no-kernel-plan-cache`) turns it off: every start times its own plan.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from mili_openai.kernels import planning
from mili_openai.kernels.planning import KernelPlan, linear_via_fp32

logger = logging.getLogger(__name__)

PLANS_DIR_NAME = "kernel-plans"
LOCK_NAME = "plans.flock"
KEY_HASH_CHARS = 16
CPU_INFO_FIELDS = ("model name", "flags")  # /proc/cpuinfo's lines that name the CPU
# the GEMMs a plan may choose for many rows, by the name its file holds
LARGE_MATMULS = {"linear_via_fp32": linear_via_fp32, "linear": F.linear}
ATTENTION_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's model name and flags ("" where /proc/cpuinfo cannot be read)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return ""
    found: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in CPU_INFO_FIELDS and name.strip() not in found:
            found[name.strip()] = value.strip()
    return " | ".join(found.get(name, "") for name in CPU_INFO_FIELDS)


def plan_key(build_name: str, threads: int | None = None, cpu: str | None = None) -> dict[str, str]:
    """What a plan was timed for (see the module docstring); its hash names the plan's file."""
    return {"cpu": cpu_identity() if cpu is None else cpu, "torch": torch.__version__,
            "threads": str(torch.get_num_threads() if threads is None else threads), "build": build_name,
            "planner": hashlib.sha256(Path(planning.__file__).read_bytes()).hexdigest()}


def plan_to_json(plan: KernelPlan, own_matmuls: dict[str, Callable] | None = None) -> dict:
    """`own_matmuls`: a kernel set's GEMMs the plan may hold besides LARGE_MATMULS, by name."""
    matmul = next(name for name, fn in (LARGE_MATMULS | (own_matmuls or {})).items() if fn == plan.large_matmul)
    dtypes = sorted(name for name, dtype in ATTENTION_DTYPES.items() if dtype in plan.prefill_attention_dtypes)
    return {"max_kernel_rows": plan.max_kernel_rows, "large_matmul": matmul, "prefill_attention_dtypes": dtypes,
            "decode_prefetch_blocks": plan.decode_prefetch_blocks}


def plan_from_json(fields: dict, own_matmuls: dict[str, Callable] | None = None) -> KernelPlan:
    """The plan a file holds; KeyError, TypeError or ValueError where it is not one this planner makes."""
    rows, blocks = fields["max_kernel_rows"], fields["decode_prefetch_blocks"]
    if rows not in planning.KERNEL_ROWS_CHOICES or blocks not in planning.DECODE_PREFETCH_CHOICES:
        raise ValueError(f"a plan with choices this planner does not make: {fields}")
    return KernelPlan(max_kernel_rows=rows, large_matmul=(LARGE_MATMULS | (own_matmuls or {}))[fields["large_matmul"]],
                      prefill_attention_dtypes=frozenset(ATTENTION_DTYPES[name]
                                                         for name in fields["prefill_attention_dtypes"]),
                      decode_prefetch_blocks=blocks)


class KernelPlanCache:
    """Plans by key in `directory`; one process times while the others starting beside it wait for its plan."""

    def __init__(self, directory: Path, own_matmuls: dict[str, Callable] | None = None) -> None:
        self.directory = Path(directory)
        self.own_matmuls = own_matmuls  # the kernel set's GEMMs a plan may name (plan_to_json)

    def path(self, key: dict[str, str]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:KEY_HASH_CHARS]
        return self.directory / f"plan-{digest}.json"

    def read(self, key: dict[str, str]) -> KernelPlan | None:
        """The plan kept for `key`, or None (none kept, or a file that is not one: it is timed again)."""
        path = self.path(key)
        try:
            stored = json.loads(path.read_text())
            if stored["key"] != key:
                raise ValueError("the file was written for another key")
            return plan_from_json(stored["plan"], self.own_matmuls)
        except FileNotFoundError:
            return None
        except (OSError, KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring the kernel plan in %s (%s): timing it again", path, exc)
            return None

    def write(self, key: dict[str, str], plan: KernelPlan) -> None:
        """Keep `plan` (whole or not at all: written beside, then renamed); a directory that cannot be
        written only costs the next start its timing."""
        path = self.path(key)
        try:
            with tempfile.NamedTemporaryFile("w", dir=self.directory, prefix=".plan-", delete=False) as handle:
                json.dump({"key": key, "plan": plan_to_json(plan, self.own_matmuls)}, handle, indent=2)
            os.replace(handle.name, path)
        except OSError as exc:
            logger.warning("could not keep the kernel plan in %s (%s): the next start times it again", path, exc)

    def read_or_time(self, key: dict[str, str], time_plan: Callable[[], KernelPlan]) -> KernelPlan:
        """The kept plan for `key`, else `time_plan()`'s, kept for the next start."""
        with self._locked():
            plan = self.read(key)
            if plan is not None:
                logger.info("CPU kernels: the plan timed at an earlier start (%s)", self.path(key))
                return plan
            plan = time_plan()
            self.write(key, plan)
            return plan

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Held while a plan is read or timed: processes starting together time it once (the rest read it);
        where the directory cannot be made, nothing is shared and each times its own."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = open(self.directory / LOCK_NAME, "a")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield  # the flock goes with the file's close


def kernel_plan(build_directory: Path, build_name: str, time_plan: Callable[[], KernelPlan], use_cache: bool,
                own_matmuls: dict[str, Callable] | None = None) -> KernelPlan:
    """A kernel set's plan: kept beside its build (read back, else timed and kept) where `use_cache`, else timed."""
    if not use_cache:
        return time_plan()
    cache = KernelPlanCache(build_directory / PLANS_DIR_NAME, own_matmuls)
    return cache.read_or_time(plan_key(build_name), time_plan)
