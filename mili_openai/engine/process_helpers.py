"""Helpers shared by the engine's processes: the server's process, the engine process (engine/engine_process.py)
and the tensor-parallel workers (engine/tp_worker.py). Importing this module pulls in neither torch nor the
model, so the server's side can use it without loading either.

- Framing over a socket: each message is a 4-byte big-endian length, then the pickled message. Both ends read
  and write frames through asyncio streams (a write never blocks: a full socket buffer queues in the
  transport), or, before an event loop runs, with a blocking `recv_frame`.
- A child's end: `describe_exit` for the log line, `exit_with_parent` so no child outlives its parent.
- `freeze_heap`: after a load, keep the loaded objects out of later garbage collections.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
from typing import Any

logger = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!I")  # the length of the pickled message that follows
ORPHAN_EXIT_CODE = 1  # what a child exits with once its parent is gone


# ---- framing ----
def encode_frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) >= 1 << (8 * FRAME_HEADER.size):
        raise ValueError(f"a {len(data)}-byte message does not fit one frame")
    return FRAME_HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; asyncio.IncompleteReadError once the other side has closed."""
    (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    return pickle.loads(await reader.readexactly(length))


def write_frame(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue one message on the transport (never blocks)."""
    writer.write(encode_frame(message))


def recv_frame(sock: socket.socket) -> Any:
    """The next message, read from a blocking socket; EOFError once the other side has closed."""
    (length,) = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
    return pickle.loads(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError("the other end of the engine socket closed")
        received += count
    return bytes(buffer)


# ---- a child's end ----
def describe_exit(code: int | None, alive: str) -> str:
    """How a child process ended, from its exit code (None: still running, then `alive` says what it did)."""
    if code is None:
        return alive
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def exit_with_parent() -> None:
    """Exit the moment the parent process does, even from inside a collective (or a step) that will never
    complete."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="mili-parent-watch", daemon=True).start()


# ---- the heap ----
def freeze_heap() -> None:
    """Collect once, then leave every object alive now (the model, the tokenizer, the libraries) out of
    later collections: a full collection over the hundreds of thousands of objects a loaded model holds
    pauses whichever thread triggers it, the event loop (every stream) or the forward thread (a step)."""
    gc.collect()
    gc.freeze()
    logger.info("garbage collector: %d objects alive after loading frozen", gc.get_freeze_count())
