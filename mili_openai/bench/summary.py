"""Aggregate figures of a run: throughputs; the mean and percentiles (p50 and p99 unless others are asked
for) of TTFT, TPOT, ITL and end-to-end latency; and, given latency bounds, vLLM's goodput (completed
requests within every bound, per second).

Percentiles interpolate linearly between order statistics (numpy's default), so p50 of [1, 2, 3, 4] is
2.5 and small samples give stable, comparable numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from mili_openai.bench.config import REPORTED_PERCENTILES
from mili_openai.bench.sse_client import SOURCE_CHUNKS, SOURCE_USAGE, RequestResult

MS_PER_S = 1000.0


def percentile(values: list[float], pct: float) -> float:
    """Linear-interpolation percentile of `values` (pct in [0, 100]); ValueError on an empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= pct <= 100:
        raise ValueError(f"pct must be in [0, 100], got {pct}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(pct: float) -> str:
    """The name of a percentile in `LatencyStats.percentiles_ms`: "p90", "p99.9"."""
    return f"p{pct:g}"


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds; all None when no request gave a value (e.g. TPOT with one-token outputs). p50 and p99
    are always there (the comparison tables read them); `percentiles_ms` holds the ones the run asked for."""

    mean_ms: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    count: int = 0
    percentiles_ms: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_seconds(cls, values: list[float], percentiles: tuple[float, ...] = REPORTED_PERCENTILES) -> LatencyStats:
        if not values:
            return cls()
        ms = [v * MS_PER_S for v in values]
        p50, p99 = (percentile(ms, p) for p in REPORTED_PERCENTILES)
        return cls(mean_ms=sum(ms) / len(ms), p50_ms=p50, p99_ms=p99, count=len(ms),
                   percentiles_ms={percentile_key(p): percentile(ms, p) for p in percentiles})


@dataclass(frozen=True, slots=True)
class BenchSummary:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float
    output_tokens_source: str  # "usage", "chunks" or "mixed": where the output token counts came from
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: list[str] = field(default_factory=list)  # the first few distinct messages, with counts
    request_goodput: float | None = None  # requests/s within every goodput bound; None without bounds
    # the share of prompt tokens the server served from its prefix cache (`cached_share`); None where it said none
    cached_prompt_share: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float, max_error_messages: int,
              goodput_slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = REPORTED_PERCENTILES) -> BenchSummary:
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return BenchSummary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(results) - len(done),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        output_tokens_source=_token_source(done),
        ttft=LatencyStats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        tpot=LatencyStats.of_seconds([r.tpot_s for r in done if r.tpot_s is not None], percentiles),
        itl=LatencyStats.of_seconds([gap for r in done for gap in r.itl_s], percentiles),
        e2e=LatencyStats.of_seconds([r.e2e_s for r in done], percentiles),
        errors=_first_errors(results, max_error_messages),
        request_goodput=sum(meets_slos(r, goodput_slos) for r in done) / duration_s if goodput_slos else None,
        cached_prompt_share=cached_share(done),
    )


def cached_share(done: list[RequestResult]) -> float | None:
    """Cached prompt tokens / prompt tokens over completed requests, a conversation's first turn left out (it
    has no history to find cached: the share then says how much of each resent history the server reused).
    None where a counted request carries no cached count (a server that does not report it)."""
    counted = [r for r in done if r.turn is None or r.turn > 1]
    if not counted or any(r.cached_tokens is None for r in counted):
        return None
    prompt = sum(r.prompt_len for r in counted)
    return sum(r.cached_tokens for r in counted) / prompt if prompt else None


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request's latencies are within every bound (ms). A one-token output has no
    TPOT, so no TPOT bound to miss (vLLM counts its TPOT as 0)."""
    latency_s = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.e2e_s}
    return all(latency_s[metric] is not None and latency_s[metric] * MS_PER_S <= bound
               for metric, bound in slos.items())


def _token_source(done: list[RequestResult]) -> str:
    sources = {r.output_tokens_source for r in done}
    if sources == {SOURCE_USAGE}:
        return SOURCE_USAGE
    if sources == {SOURCE_CHUNKS}:
        return SOURCE_CHUNKS
    return "mixed" if sources else "none"


def _first_errors(results: list[RequestResult], limit: int) -> list[str]:
    counts = Counter(r.error for r in results if r.error is not None)  # keeps first-seen order
    return [f"{message} (x{n})" for message, n in list(counts.items())[:limit]]
