"""What the server's process and its engine process say to each other (framed over one socket pair by
engine/process_helpers.py).

Server -> engine: `Submit`, `Abort`, and the calls (`Call`) answered by a `Reply` with the same `call_id`. A
`Submit` whose request has a structured-output format is answered too (its `call_id` set): the engine compiles
the format before it queues the request, and a bad one comes back as the caller's ValueError.
Engine -> server: `EngineReady`/`EngineFailed` once, then `Outputs` (every delta and finished-request
metrics of one loop tick, and a stats snapshot) and `Reply`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.contract import EngineInfo, EngineRequest
from mili_openai.engine.outputs import EngineStats, RequestMetrics, SequenceDelta


# ---- engine -> server, once ----
@dataclass(slots=True)
class EngineReady:
    """The loaded engine: its process, what the API side needs of it, and its stats before any request."""

    pid: int
    info: EngineInfo
    stats: EngineStats


@dataclass(slots=True)
class EngineFailed:
    """The engine did not load: the exception (or, if it does not pickle, a RuntimeError with its text)."""

    error: BaseException


# ---- server -> engine ----
@dataclass(slots=True)
class Submit:
    request: EngineRequest  # checked in the server's process
    request_id: str
    call_id: int | None = None  # set: answered by a Reply once the request is queued (or refused)


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Call:
    """A call the server awaits: `method` is "start", "shutdown", "page_accounting", "start_profile" or
    "stop_profile"."""

    call_id: int
    method: str
    args: tuple = ()


# ---- engine -> server ----
@dataclass(slots=True)
class Outputs:
    """One loop tick of the engine: its deltas, the metrics of the sequences that finished, and then-stats."""

    deltas: list[SequenceDelta] = field(default_factory=list)
    finished: list[RequestMetrics] = field(default_factory=list)
    stats: EngineStats | None = None
    sequences_received: int = 0  # sequences of every Submit the engine has taken so far
    fatal_error: str | None = None  # the engine can run no more steps (a tensor-parallel worker died)


@dataclass(slots=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None  # raised in the server (a ValueError: the caller's 400)
