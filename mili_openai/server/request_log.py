"""What the server knows about one HTTP request while it runs, and the log line written when it ends.

The request-context middleware creates one `RequestContext` per request and makes it reachable
through a `ContextVar`, so that the generation helpers (routes/job.py) and `ServerState.check_queue`
can update it without every route threading it through its calls. A ContextVar rather than a module
global: each request's task (and the SSE task it starts, which copies the context) sees its own
object, and nothing outlives the request.

The context feeds two things: the bounded waiting room (sequences admitted by a route but not yet
submitted to the engine count toward `max_queue`), and one JSON line per finished request on the
`mili_openai.requests` logger. The line is the whole message (the CLI gives this logger a bare
`%(message)s` handler), so log pipelines can parse it as-is:

    {"event": "request", "request_id": "...", "method": "POST", "endpoint": "/v1/completions",
     "status": 200, "prompt_tokens": 12, "cached_tokens": 0, "output_tokens": 16, "num_sequences": 1,
     "ttft_s": 0.031, "total_s": 0.254, "finish_reasons": ["length"]}

Token fields are null for requests that generated nothing (errors before submission, /v1/models...).
Probes and scrapes (`QUIET_PATHS`) are not logged: they would drown the lines that matter.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from mili_openai.engine.outputs import SequenceDelta


class PendingSequences(Protocol):
    """The count a request's context reserves into (`ServerState`; typed here, since server/state.py imports
    this module)."""

    pending_sequences: int


REQUEST_LOGGER_NAME = "mili_openai.requests"
QUIET_PATHS = frozenset({"/health", "/metrics"})
TIME_DECIMALS = 4  # 0.1 ms: finer is noise next to the event loop's own jitter


SampleKey = tuple[str, int]  # (engine request id, sample index)


@dataclass(slots=True)
class SequenceTally:
    """What one sample of the request produced (counted the way `usage` counts them)."""

    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True, eq=False)
class RequestTally:
    """What one HTTP request's engine requests produced, counted as `usage` counts it: the one tally of its
    deltas, read by the route's usage (routes/job.py) and by the request's log line."""

    num_prompt_tokens: int = 0  # each prompt once, however many samples it has
    # every sample of every engine request it submitted; sample 0's cached tokens count for its prompt
    sequences: dict[SampleKey, SequenceTally] = field(default_factory=dict)
    first_token_time: float | None = None

    def note_submitted(self, num_prompt_tokens: int, request_ids: list[str], num_samples: int) -> None:
        """Engine requests submitted for `num_prompt_tokens` of prompts, `num_samples` samples each."""
        self.num_prompt_tokens += num_prompt_tokens
        for request_id in request_ids:
            for index in range(num_samples):
                self.sequences.setdefault((request_id, index), SequenceTally())

    def observe(self, delta: SequenceDelta) -> None:
        key = (delta.request_id, delta.index)
        tally = self.sequences.get(key)
        if tally is None:
            tally = self.sequences[key] = SequenceTally()
        tally.num_output_tokens += len(delta.token_ids)
        tally.num_cached_tokens = delta.num_cached_tokens
        if delta.token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if delta.finish_reason is not None:
            tally.finish_reason = delta.finish_reason

    @property
    def num_output_tokens(self) -> int:
        return sum(t.num_output_tokens for t in self.sequences.values())

    @property
    def num_cached_tokens(self) -> int:
        return sum(tally.num_cached_tokens for (_, index), tally in self.sequences.items() if index == 0)

    @property
    def finish_reasons(self) -> list[str | None]:
        return [t.finish_reason for t in self.sequences.values()]


@dataclass(slots=True, eq=False)
class RequestContext:
    request_id: str
    method: str
    path: str  # the raw path; the route template is read from the scope when the request ends
    server: PendingSequences
    arrival_time: float = field(default_factory=time.monotonic)
    reserved_sequences: int = 0  # counted in server.pending_sequences until submitted or finished
    tally: RequestTally = field(default_factory=RequestTally)  # what its engine requests produced

    # ---- the waiting room ----
    def reserve(self, num_sequences: int) -> None:
        """Count `num_sequences` as queued until the route submits them (or the request ends)."""
        self.release()
        self.reserved_sequences = num_sequences
        self.server.pending_sequences += num_sequences

    def release(self) -> None:
        """Stop counting the reservation (idempotent): the engine's waiting list counts them now."""
        self.server.pending_sequences -= self.reserved_sequences
        self.reserved_sequences = 0

    def note_submitted(self, num_prompt_tokens: int, request_ids: list[str], num_samples: int) -> None:
        """The route submitted its engine requests (see `RequestTally.note_submitted`): the reservation ends."""
        self.release()
        self.tally.note_submitted(num_prompt_tokens, request_ids, num_samples)


CURRENT_REQUEST: ContextVar[RequestContext | None] = ContextVar("mili_request_context", default=None)


def current_request() -> RequestContext | None:
    """The context of the HTTP request being handled, or None outside one (offline use, unit tests)."""
    return CURRENT_REQUEST.get()


def request_log_record(context: RequestContext, endpoint: str, status: int, finished_time: float) -> dict[str, Any]:
    tally = context.tally
    generated = bool(tally.sequences)  # whether it submitted anything to the engine
    ttft = None
    if tally.first_token_time is not None:
        ttft = round(tally.first_token_time - context.arrival_time, TIME_DECIMALS)
    return {
        "event": "request",
        "request_id": context.request_id,
        "method": context.method,
        "endpoint": endpoint,
        "status": status,
        "prompt_tokens": tally.num_prompt_tokens if generated else None,
        "cached_tokens": tally.num_cached_tokens if generated else None,
        "output_tokens": tally.num_output_tokens if generated else None,
        "num_sequences": len(tally.sequences),
        "ttft_s": ttft,
        "total_s": round(finished_time - context.arrival_time, TIME_DECIMALS),
        "finish_reasons": tally.finish_reasons,
    }


def log_finished_request(logger: logging.Logger, context: RequestContext, endpoint: str, status: int) -> None:
    if context.path in QUIET_PATHS or not logger.isEnabledFor(logging.INFO):
        return
    record = request_log_record(context, endpoint, status, time.monotonic())
    logger.info(orjson.dumps(record).decode())
