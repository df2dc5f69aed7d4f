"""Progress records of `/generate` requests, for `GET /status/{request_id}`.

Live requests are kept until they finish; finished ones stay in a bounded LRU so a client can read
the outcome shortly after, without the server's memory growing with its uptime.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.outputs import SequenceDelta

MAX_FINISHED_RECORDS = 1024  # finished requests remembered for /status
MAX_LIVE_RECORDS = 65536  # guard against unbounded growth if requests never finish


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.time)  # wall clock, seconds since the epoch
    state: str = "waiting"  # waiting (no token yet) -> running -> finished | aborted
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None

    def observe(self, delta: SequenceDelta) -> None:
        now = time.time()
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.token_ids and self.first_token_time is None:
            self.first_token_time = now
        if delta.finish_reason is None:
            if self.token_ids:
                self.state = "running"
            return
        self.finish_reason = delta.finish_reason
        self.finished_time = now
        self.state = "aborted" if delta.finish_reason == "abort" else "finished"

    def to_dict(self) -> dict[str, Any]:
        end = self.finished_time if self.finished_time is not None else time.time()
        return {
            "request_id": self.request_id,
            "state": self.state,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": len(self.token_ids),
            "token_ids": self.token_ids,
            "text": self.text,
            "timings": {
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "finished_time": self.finished_time,
                "time_to_first_token_s": (
                    None if self.first_token_time is None else self.first_token_time - self.arrival_time
                ),
                "elapsed_s": end - self.arrival_time,
            },
        }


class RequestRecords:
    def __init__(self, max_finished: int = MAX_FINISHED_RECORDS) -> None:
        if max_finished < 1:
            raise ValueError("max_finished must be >= 1")
        self.max_finished = max_finished
        self._live: dict[str, RequestRecord] = {}
        self._finished: OrderedDict[str, RequestRecord] = OrderedDict()

    def start(self, request_id: str, num_prompt_tokens: int) -> RequestRecord:
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self._live) >= MAX_LIVE_RECORDS:
            raise ValueError("too many requests in flight")
        self._finished.pop(request_id, None)  # a reused id now means the new request
        record = RequestRecord(request_id, num_prompt_tokens)
        self._live[request_id] = record
        return record

    def close(self, record: RequestRecord) -> None:
        """Move a live record to the finished LRU (an unfinished one is recorded as aborted); idempotent."""
        if self._live.get(record.request_id) is not record:
            return
        del self._live[record.request_id]
        if record.finished_time is None:
            record.state, record.finish_reason, record.finished_time = "aborted", "abort", time.time()
        self._finished[record.request_id] = record
        while len(self._finished) > self.max_finished:
            self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._live.get(request_id) or self._finished.get(request_id)

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)
