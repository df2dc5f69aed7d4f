"""Prometheus metrics of one server, in its own CollectorRegistry (no import-time globals).

Per-request histograms are fed by the engine's observer hook when each sequence finishes; gauges and
engine-wide counters are read from `engine.stats()` at scrape time, so they cost nothing per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from mili_openai.engine.outputs import EngineStats, RequestMetrics

# Latency buckets in seconds: from a fast decode step on a GPU to a long CPU generation.
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


# the pooling APIs, as the pooling counters label them: /v1/embeddings, /score, /rerank (all three paths), /classify
EMBEDDINGS_API, SCORE_API, RERANK_API, CLASSIFY_API = "embeddings", "score", "rerank", "classify"
POOLING_APIS = (EMBEDDINGS_API, SCORE_API, RERANK_API, CLASSIFY_API)

# (metric name, help, EngineStats field) of the engine-wide counters; the client adds "_total" to names
ENGINE_COUNTERS = (
    ("mili_prompt_tokens", "Prompt tokens of finished sequences.", "prompt_tokens_total"),
    ("mili_generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("mili_preemptions", "Sequences preempted for lack of KV pages.", "num_preemptions_total"),
    ("mili_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries_total"),
    ("mili_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits_total"),
    ("mili_spec_decode_num_drafts", "Decodes that verified speculative draft tokens.", "spec_decode_num_drafts_total"),
    ("mili_spec_decode_num_draft_tokens", "Speculative draft tokens verified.", "spec_decode_num_draft_tokens_total"),
    ("mili_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
     "spec_decode_num_accepted_tokens_total"),
    ("mili_state_snapshots_evicted", "State snapshots evicted while their K/V pages stayed cached.",
     "state_snapshots_evicted_total"),
)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # the model is still loading
            return
        yield GaugeMetricFamily("mili_num_requests_running", "Sequences in the running batch.", value=stats.num_running)
        yield GaugeMetricFamily("mili_num_requests_waiting", "Sequences waiting to be scheduled.",
                                value=stats.num_waiting)
        yield GaugeMetricFamily(
            "mili_kv_cache_usage_ratio", "Fraction of KV cache pages in use (by requests or the prefix cache).",
            value=stats.kv_cache_usage,
        )
        yield GaugeMetricFamily("mili_kv_cache_pages", "KV cache pages in the pool.", value=stats.num_pages)
        yield GaugeMetricFamily(
            "mili_prefix_cache_pages", "KV pages held by the radix prefix cache.", value=stats.num_cached_pages
        )
        yield GaugeMetricFamily("mili_state_slots", "State slots of the linear-attention layers (0: none).",
                                value=stats.num_state_slots)
        yield GaugeMetricFamily("mili_state_slots_used", "State slots held by running sequences.",
                                value=stats.num_state_slots - stats.num_free_state_slots)
        if stats.max_lora:  # vLLM's shape, which the Gateway API inference extension's endpoint picker reads
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters (the value: "
                                     "the scrape's Unix time).",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                             str(stats.max_lora)], time.time())
            yield info
        yield GaugeMetricFamily("mili_state_snapshots", "Prefix-cache state snapshots of a hybrid model (0: none).",
                                value=stats.num_state_snapshots)
        yield GaugeMetricFamily("mili_state_snapshots_cached", "State snapshots attached to the radix prefix cache.",
                                value=stats.num_state_snapshots_attached)
        yield GaugeMetricFamily("mili_state_snapshot_bytes", "Memory of the prefix cache's state snapshots.",
                                value=stats.state_snapshot_bytes)
        for name, documentation, field in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, documentation, value=getattr(stats, field))
        yield from _per_position_counters(stats)


def _per_position_counters(stats: EngineStats) -> Iterator[Metric]:
    """Speculative drafts verified and kept at each draft position, labelled `position` (0: the first draft)."""
    for name, documentation, values in (
        ("mili_spec_decode_num_draft_tokens_per_pos", "Speculative draft tokens verified, by draft position.",
         stats.spec_decode_num_draft_tokens_per_pos),
        ("mili_spec_decode_num_accepted_tokens_per_pos", "Speculative draft tokens accepted, by draft position.",
         stats.spec_decode_num_accepted_tokens_per_pos),
    ):
        family = CounterMetricFamily(name, documentation, labels=["position"])
        for position, value in enumerate(values):
            family.add_metric([str(position)], value)
        yield family


class ServerMetrics:
    """All of one server's collectors; also the engine's observer (`on_request_finished`)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        self.time_to_first_token = Histogram(
            "mili_time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "mili_time_per_output_token_seconds", "Mean time between output tokens after the first, per sequence.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "mili_e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_time = Histogram(
            "mili_request_queue_time_seconds", "Time from arrival to first being scheduled.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests_finished = Counter(
            "mili_requests_finished", "Sequences finished, by finish reason.", ["finish_reason"], registry=self.registry
        )
        self.http_requests = Counter(
            "mili_http_requests", "HTTP requests answered.", ["method", "path", "status"], registry=self.registry
        )
        self.rejected_requests = Counter(
            "mili_rejected_requests", "Requests refused before reaching the engine.", ["reason"], registry=self.registry
        )
        # path: only routes with fixed paths read a body or stream, so the label stays bounded
        self.client_disconnects = Counter(
            "mili_client_disconnects", "Clients that closed the connection before their answer was complete, by "
            "path and phase (request_body, before_response, stream).", ["path", "phase"], registry=self.registry
        )

        # vLLM counts requests and prompt tokens; a pooling request holds many inputs, each an engine request
        self.pooling_requests = Counter(
            "mili_pooling_requests", "Pooling API requests submitted to the engine (embeddings, scores, reranking, "
            "classification), by API.", ["api"], registry=self.registry)
        self.pooling_inputs = Counter(
            "mili_pooling_inputs", "Inputs of pooling API requests, each one run through the model (a text "
            "embedded, a pair a reranker scores, a text classified), by API.", ["api"], registry=self.registry)
        self.pooling_prompt_tokens = Counter(
            "mili_pooling_prompt_tokens", "Prompt tokens of pooling API requests, after truncation, by API.", ["api"],
            registry=self.registry)
        for api in POOLING_APIS:  # each series from zero, so a rate over the first request is right
            for counter in (self.pooling_requests, self.pooling_inputs, self.pooling_prompt_tokens):
                counter.labels(api)

    def on_pooling_request(self, api: str, num_inputs: int, num_prompt_tokens: int) -> None:
        """A pooling request's inputs went to the engine (routes/pooling.py)."""
        self.pooling_requests.labels(api).inc()
        self.pooling_inputs.labels(api).inc(num_inputs)
        self.pooling_prompt_tokens.labels(api).inc(num_prompt_tokens)

    def on_request_finished(self, metrics: RequestMetrics) -> None:
        self.requests_finished.labels(metrics.finish_reason).inc()
        self.e2e_latency.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
            if metrics.num_output_tokens > 1:
                decode_time = metrics.finished_time - metrics.first_token_time
                self.time_per_output_token.observe(decode_time / (metrics.num_output_tokens - 1))

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def endpoint(self, request: Request) -> Response:
        """GET /metrics."""
        return self.render()
