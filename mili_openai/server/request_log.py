"""One structured log line per finished HTTP request, as JSON on the `mili_openai.requests` logger.

The line is the whole message (the CLI gives this logger a bare `%(message)s` handler), so log
pipelines can parse it as-is:

    {"event": "request", "request_id": "...", "method": "POST", "endpoint": "/v1/completions",
     "status": 200, "prompt_tokens": 12, "cached_tokens": 0, "output_tokens": 16, "num_sequences": 1,
     "ttft_s": 0.031, "total_s": 0.254, "finish_reasons": ["length"]}

Token fields are null for requests that generated nothing (errors before submission, /v1/models...).
Probes and scrapes (`QUIET_PATHS`) are not logged: they would drown the lines that matter.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from mili_openai.server.request_context import RequestContext

REQUEST_LOGGER_NAME = "mili_openai.requests"
QUIET_PATHS = frozenset({"/health", "/metrics"})
TIME_DECIMALS = 4  # 0.1 ms: finer is noise next to the event loop's own jitter


def request_log_record(context: RequestContext, endpoint: str, status: int, finished_time: float) -> dict[str, Any]:
    generated = context.generated
    ttft = None
    if context.first_token_time is not None:
        ttft = round(context.first_token_time - context.arrival_time, TIME_DECIMALS)
    return {
        "event": "request",
        "request_id": context.request_id,
        "method": context.method,
        "endpoint": endpoint,
        "status": status,
        "prompt_tokens": context.num_prompt_tokens if generated else None,
        "cached_tokens": context.num_cached_tokens if generated else None,
        "output_tokens": context.num_output_tokens if generated else None,
        "num_sequences": len(context.sequences),
        "ttft_s": ttft,
        "total_s": round(finished_time - context.arrival_time, TIME_DECIMALS),
        "finish_reasons": context.finish_reasons,
    }


def log_finished_request(logger: logging.Logger, context: RequestContext, endpoint: str, status: int) -> None:
    if context.path in QUIET_PATHS or not logger.isEnabledFor(logging.INFO):
        return
    record = request_log_record(context, endpoint, status, time.monotonic())
    logger.info(orjson.dumps(record).decode())
