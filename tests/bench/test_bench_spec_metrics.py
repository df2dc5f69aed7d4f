"""The bench's draft acceptance by position: per-position counters parsed from a Prometheus exposition as
mili's /metrics writes it, and their change over a run."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from mili_openai.bench.spec_metrics import acceptance_by_position, per_position_counts
from mili_openai.engine.outputs import EngineStats
from mili_openai.server.metrics import EngineStatsCollector


def exposition(drafts: tuple[int, ...], accepted: tuple[int, ...]) -> str:
    stats = EngineStats(num_running=0, num_waiting=0, num_pages=8, num_free_pages=8, num_cached_pages=0,
                        kv_cache_usage=0.0, num_preemptions_total=0, prefix_cache_queries_total=0,
                        prefix_cache_hits_total=0, prompt_tokens_total=0, generation_tokens_total=0,
                        spec_decode_num_draft_tokens_per_pos=drafts, spec_decode_num_accepted_tokens_per_pos=accepted)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats))
    return generate_latest(registry).decode()


def test_acceptance_by_position_over_a_run():
    before = per_position_counts(exposition((10, 8), (7, 4)))
    after = per_position_counts(exposition((30, 26, 5), (22, 13, 1)))
    assert acceptance_by_position(before, after) == [
        {"position": 0, "drafts": 20, "accepted": 15, "rate": 0.75},
        {"position": 1, "drafts": 18, "accepted": 9, "rate": 0.5},
        {"position": 2, "drafts": 5, "accepted": 1, "rate": 0.2},
    ]


def test_a_server_without_the_counters_reports_none():
    empty = per_position_counts("# HELP other_total x\nother_total 3.0\n")
    assert acceptance_by_position(empty, empty) is None
    assert acceptance_by_position(None, empty) is None
