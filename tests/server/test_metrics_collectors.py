"""ServerMetrics on its own: the exposition parses and every metric the docs list is present."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mili_openai.engine.outputs import EngineStats, RequestMetrics
from mili_openai.server.metrics import ServerMetrics


def stats(**overrides) -> EngineStats:
    values = dict(num_running=2, num_waiting=3, num_pages=100, num_free_pages=60, num_cached_pages=10,
                  kv_cache_usage=0.4, num_preemptions_total=1, prefix_cache_queries_total=500,
                  prefix_cache_hits_total=128, prompt_tokens_total=500, generation_tokens_total=40)
    values.update(overrides)
    return EngineStats(**values)


def parse(metrics: ServerMetrics) -> dict[str, dict]:
    text = metrics.render().body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_engine_gauges_and_counters_come_from_stats():
    current = {"stats": stats()}
    metrics = ServerMetrics(lambda: current["stats"])
    samples = parse(metrics)
    assert samples["mili_num_requests_running"][0].value == 2
    assert samples["mili_num_requests_waiting"][0].value == 3
    assert samples["mili_kv_cache_usage_ratio"][0].value == 0.4
    assert samples["mili_prefix_cache_hits_total"][0].value == 128
    assert samples["mili_prompt_tokens_total"][0].value == 500
    current["stats"] = stats(generation_tokens_total=41)
    assert parse(metrics)["mili_generation_tokens_total"][0].value == 41


def test_hybrid_state_snapshots_are_shown():
    samples = parse(ServerMetrics(lambda: stats(num_state_snapshots=8, num_state_snapshots_attached=5,
                                                state_snapshot_bytes=8 << 20, state_snapshots_evicted_total=3)))
    assert samples["mili_state_snapshots"][0].value == 8
    assert samples["mili_state_snapshots_cached"][0].value == 5
    assert samples["mili_state_snapshot_bytes"][0].value == 8 << 20
    assert samples["mili_state_snapshots_evicted_total"][0].value == 3


def test_nothing_from_the_engine_while_loading():
    samples = parse(ServerMetrics(lambda: None))
    assert "mili_num_requests_running" not in samples
    assert "mili_time_to_first_token_seconds_count" in samples


def test_request_histograms_observe_finished_sequences():
    metrics = ServerMetrics(lambda: stats())
    metrics.on_request_finished(RequestMetrics(
        request_id="a", arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0,
        num_prompt_tokens=5, num_cached_tokens=0, num_output_tokens=5, finish_reason="length", num_preemptions=0,
    ))
    metrics.on_request_finished(RequestMetrics(
        request_id="b", arrival_time=10.0, first_scheduled_time=None, first_token_time=None, finished_time=10.2,
        num_prompt_tokens=5, num_cached_tokens=0, num_output_tokens=0, finish_reason="abort", num_preemptions=0,
    ))
    samples = parse(metrics)
    assert samples["mili_time_to_first_token_seconds_count"][0].value == 1
    assert samples["mili_time_to_first_token_seconds_sum"][0].value == 1.0
    assert samples["mili_time_per_output_token_seconds_sum"][0].value == 0.5  # 2 s over 4 gaps
    assert samples["mili_request_queue_time_seconds_sum"][0].value == 0.5
    assert samples["mili_e2e_request_latency_seconds_count"][0].value == 2
    by_reason = {s.labels["finish_reason"]: s.value for s in samples["mili_requests_finished_total"]}
    assert by_reason == {"length": 1, "abort": 1}
