"""A server under test as a child process: start it, wait until it answers its health route, stop it.

Used by `scripts/compare_serving.py` and the end-to-end bench test. The child gets its own session (process
group) so that stopping it also stops anything it spawned (e.g. a uvicorn worker), and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HEALTH_POLL_INTERVAL_S = 0.5
HEALTH_REQUEST_TIMEOUT_S = 5.0
STOP_GRACE_S = 15.0  # SIGTERM first (lets a server drain and free its port), SIGKILL after this
LOG_TAIL_CHARS = 4000  # how much of the child's log an error message quotes
LOCALHOST = "127.0.0.1"


def build_cpu_kernels_first() -> None:
    """Build the CPU kernels here, before a benchmark starts mili on CPU: a server that finds them unbuilt
    answers on torch's ops while it compiles them (a first start), and the benchmark would time that."""
    from mili_openai.kernels import load_cpu_kernels  # torch and the build only where a benchmark asks
    from mili_openai.kernels.cpu_avx2 import load_avx2_kernels

    if load_cpu_kernels() is None:  # a CPU without AVX-512: the AVX2 set
        load_avx2_kernels()


def free_port(host: str = LOCALHOST) -> int:
    """A port the OS just handed out; another process could take it before the server binds (rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str  # for logs and tables, e.g. "mili"
    argv: tuple[str, ...]
    base_url: str
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)  # added to the parent's environment


class ServerProcess:
    """Context manager: `with ServerProcess(spec, log_path) as server: server.wait_healthy(600)`."""

    def __init__(self, spec: ServerSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError(f"{self.spec.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                list(self.spec.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env}, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll the health route until it answers 200; returns the seconds it took. RuntimeError if the
        process exits or the deadline passes first (the message quotes the end of its log)."""
        if self.process is None:
            raise RuntimeError(f"{self.spec.name} was not started")
        started = time.monotonic()
        url = self.spec.base_url.rstrip("/") + self.spec.health_path
        with httpx.Client(timeout=HEALTH_REQUEST_TIMEOUT_S) as client:
            while time.monotonic() - started < timeout_s:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(url).status_code == httpx.codes.OK:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(HEALTH_POLL_INTERVAL_S)
        raise RuntimeError(f"{self.spec.name} not healthy after {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after STOP_GRACE_S; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        pgid = os.getpgid(self.process.pid)  # == pid: the child leads the session it was started in
        os.killpg(pgid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            return self.process.wait()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"
