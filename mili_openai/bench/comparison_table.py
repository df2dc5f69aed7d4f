"""Side-by-side markdown of `bench serve` results (one JSON per workload × server) with ratios, and the
in-place update of a marked section of a markdown file (so the file can hold other, hand-written parts).

Ratios are oriented so that > 1 always means the first server does better: its rate / the peer's rate
for throughputs, the peer's latency / its latency for latencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

HIGHER_IS_BETTER = "higher"
LOWER_IS_BETTER = "lower"


@dataclass(frozen=True, slots=True)
class Metric:
    label: str
    path: tuple[str, ...]  # keys into the summary JSON
    better: str | None  # None: shown, not compared (counts)
    digits: int = 1


METRICS = (
    Metric("completed / failed", ("completed",), None, 0),
    Metric("output tokens (total)", ("total_output_tokens",), None, 0),
    Metric("output tok/s", ("output_throughput",), HIGHER_IS_BETTER),
    Metric("TTFT p50 (ms)", ("ttft", "p50_ms"), LOWER_IS_BETTER),
    Metric("TTFT p99 (ms)", ("ttft", "p99_ms"), LOWER_IS_BETTER),
    Metric("TPOT p50 (ms)", ("tpot", "p50_ms"), LOWER_IS_BETTER),
    Metric("TPOT p99 (ms)", ("tpot", "p99_ms"), LOWER_IS_BETTER),
    Metric("ITL p50 (ms)", ("itl", "p50_ms"), LOWER_IS_BETTER),
    Metric("ITL p99 (ms)", ("itl", "p99_ms"), LOWER_IS_BETTER),
    Metric("E2E p99 (ms)", ("e2e", "p99_ms"), LOWER_IS_BETTER),
    Metric("cached prompt share", ("cached_prompt_share",), HIGHER_IS_BETTER, 2),
    Metric("duration (s)", ("duration_s",), LOWER_IS_BETTER, 2),
)


def metric_value(summary: dict[str, Any], metric: Metric) -> float | None:
    value: Any = summary
    for key in metric.path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def advantage(ours: float | None, peer: float | None, better: str | None) -> float | None:
    """> 1 when `ours` is better; None when not comparable (missing value, zero, or a count)."""
    if better is None or ours is None or peer is None or ours <= 0 or peer <= 0:
        return None
    return ours / peer if better == HIGHER_IS_BETTER else peer / ours


def render_workload_table(servers: list[str], summaries: dict[str, dict[str, Any]]) -> str:
    """Rows = metrics, columns = servers (missing ones shown as "—") and `first ÷ other` advantages."""
    first, others = servers[0], servers[1:]
    header = ["metric", *servers, *(f"{first} advantage vs {o} (×)" for o in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for metric in METRICS:
        cells = [metric.label]
        for server in servers:
            cells.append(_format_cell(summaries.get(server), metric))
        ours = metric_value(summaries[first], metric) if first in summaries else None
        for other in others:
            peer = metric_value(summaries[other], metric) if other in summaries else None
            ratio = advantage(ours, peer, metric.better)
            cells.append("—" if ratio is None else f"{ratio:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _format_cell(summary: dict[str, Any] | None, metric: Metric) -> str:
    if summary is None:
        return "—"
    if metric.path == ("completed",):
        return f"{summary.get('completed', 0)} / {summary.get('failed', 0)}"
    value = metric_value(summary, metric)
    if value is None:
        return "n/a"
    text = f"{value:.{metric.digits}f}"
    if metric.path == ("total_output_tokens",):
        text += f" ({summary.get('output_tokens_source', '?')})"
    return text


def replace_marked_section(document: str, begin: str, end: str, body: str) -> str:
    """`document` with the text between the `begin` and `end` marker lines replaced by `body`; the marked
    section is appended when absent. ValueError when only one marker is present or they are out of order."""
    section = f"{begin}\n{body.rstrip()}\n{end}"
    has_begin, has_end = begin in document, end in document
    if not has_begin and not has_end:
        return (document.rstrip() + "\n\n" if document.strip() else "") + section + "\n"
    if has_begin != has_end:
        raise ValueError(f"only one of the markers {begin!r} / {end!r} is present")
    start, stop = document.index(begin), document.index(end)
    if stop < start:
        raise ValueError("the end marker comes before the begin marker")
    return document[:start] + section + document[stop + len(end):]


def update_marked_file(path: str | Path, begin: str, end: str, body: str, title: str) -> Path:
    """Write `body` between the markers of `path`, creating the file (with `title`) when missing."""
    target = Path(path)
    document = target.read_text() if target.exists() else f"# {title}\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(replace_marked_section(document, begin, end, body))
    return target
