"""What the server's process and its engine process say to each other, and how it travels.

One socket pair joins them. Each message is a frame: a 4-byte big-endian length, then the pickled message.
Both sides read and write frames through asyncio streams, so a write never blocks (a full socket buffer
queues in the transport) and neither side can deadlock waiting on the other; before the engine's loop runs,
the child's first message (`EngineReady` or `EngineFailed`) is read with a blocking `recv_frame`.

Server -> engine: `Submit`, `Abort`, and the calls (`Call`) answered by a `Reply` with the same `call_id`.
Engine -> server: `EngineReady`/`EngineFailed` once, then `Outputs` (every delta and finished-request
metrics of one loop tick, and a stats snapshot) and `Reply`s.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mili_openai.engine.core import RequestLimits
from mili_openai.engine.outputs import EngineStats, RequestMetrics, SequenceDelta
from mili_openai.engine.sampling_params import SamplingDefaults, SamplingParams

FRAME_HEADER = struct.Struct("!I")  # the length of the pickled message that follows


def encode_frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) >= 1 << (8 * FRAME_HEADER.size):
        raise ValueError(f"a {len(data)}-byte message does not fit one frame")
    return FRAME_HEADER.pack(len(data)) + data


def decode_frame_body(data: bytes) -> Any:
    return pickle.loads(data)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; asyncio.IncompleteReadError once the other side has closed."""
    (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    return decode_frame_body(await reader.readexactly(length))


def write_frame(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue one message on the transport (never blocks)."""
    writer.write(encode_frame(message))


def recv_frame(sock: socket.socket) -> Any:
    """The next message, read from a blocking socket; EOFError once the other side has closed."""
    (length,) = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
    return decode_frame_body(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError("the other end of the engine socket closed")
        received += count
    return bytes(buffer)


# ---- engine -> server, once ----
@dataclass(slots=True)
class EngineReady:
    """The loaded engine: what `EngineClient` exposes, and the limits `check_request` reads."""

    pid: int
    tokenizer: Any  # the engine's own tokenizer, pickled: the server tokenizes exactly as the engine decodes
    model_path: Path | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    quantization: str | None
    sampling_defaults: SamplingDefaults
    limits: RequestLimits
    stats: EngineStats


@dataclass(slots=True)
class EngineFailed:
    """The engine did not load: the exception (or, if it does not pickle, a RuntimeError with its text)."""

    error: BaseException


# ---- server -> engine ----
@dataclass(slots=True)
class Submit:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Call:
    """A call the server awaits: `method` is "start", "shutdown", "compile_format", "page_accounting",
    "start_profile" or "stop_profile"."""

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
