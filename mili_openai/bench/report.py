"""Human table and JSON file of a finished run."""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from mili_openai.bench.config import MULTI_TURN
from mili_openai.bench.runner import BenchRun
from mili_openai.bench.summary import LatencyStats, percentile_key

LABEL_WIDTH = 40
RULE_WIDTH = 60
BYTES_PER_MIB = 1 << 20
LATENCY_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


def format_table(run: BenchRun) -> str:
    s, c = run.summary, run.config
    rows: list[tuple[str, str]] = [
        ("Endpoint", c.url),
        ("Model", run.model),
        ("Dataset", c.dataset + (f" (lengths within ±{c.random_range_ratio:g})"
                                 if c.dataset == "random" and c.random_range_ratio else "")
                    + (f" ({c.num_conversations} conversations x {c.num_turns} turns)"
                       if c.dataset == MULTI_TURN else "")),
        ("Concurrency / request rate", f"{c.concurrency or 'unbounded'} / {c.to_json()['request_rate']} req/s"
                                       + (f", burstiness {c.burstiness:g}"
                                          if c.burstiness != 1 and not math.isinf(c.request_rate) else "")),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Completed requests", str(s.completed)),
        ("Failed requests", str(s.failed)),
        ("Total input tokens", str(s.total_input_tokens)),
        (f"Total output tokens (from {s.output_tokens_source})", str(s.total_output_tokens)),
        ("Request throughput (req/s)", f"{s.request_throughput:.3f}"),
        *([("Goodput bounds", _bounds(c.goodput_slos)), ("Request goodput (req/s)", f"{s.request_goodput:.3f}")]
          if s.request_goodput is not None else []),
        ("Input token throughput (tok/s)", f"{s.input_throughput:.1f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}"),
    ]
    if s.cached_prompt_share is not None:
        scope = "from turn 2 on" if c.dataset == MULTI_TURN else "all requests"
        rows.append((f"Cached prompt tokens ({scope})", f"{s.cached_prompt_share:.1%}"))
    if run.snapshot_memory is not None:
        memory = run.snapshot_memory
        used_mib, budget_mib = memory["used_bytes"] / BYTES_PER_MIB, memory["budget_bytes"] / BYTES_PER_MIB
        rows.append(("State snapshots cached / budget",
                     f"{memory['cached']} / {memory['snapshots']} ({used_mib:.1f} / {budget_mib:.1f} MiB)"))
    for key, name in LATENCY_ROWS:
        stats: LatencyStats = getattr(s, key)
        rows.append((f"Mean {name} (ms)", _ms(stats.mean_ms)))
        rows += [(f"P{pct:g} {name} (ms)", _ms(stats.percentiles_ms.get(percentile_key(pct))))
                 for pct in c.metric_percentiles]
    lines = [" Serving Benchmark Result ".center(RULE_WIDTH, "=")]
    lines += [f"{label:<{LABEL_WIDTH}}{value}" for label, value in rows]
    for row in run.acceptance or ():
        rate = "n/a" if row["rate"] is None else f"{row['rate']:.1%}"
        lines.append(f"{'Draft acceptance, position ' + str(row['position']):<{LABEL_WIDTH}}"
                     f"{rate} ({row['accepted']}/{row['drafts']})")
    if run.warmup_failed:
        lines.append(f"{'Failed warmup requests':<{LABEL_WIDTH}}{run.warmup_failed}")
    if s.errors:
        lines.append(" Errors ".center(RULE_WIDTH, "-"))
        lines += s.errors
    lines.append("=" * RULE_WIDTH)
    return "\n".join(lines)


def write_json(run: BenchRun, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(orjson.dumps(run.to_json(), option=orjson.OPT_INDENT_2))
    return target


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _bounds(slos: dict[str, float]) -> str:
    return ", ".join(f"{metric} <= {bound:g} ms" for metric, bound in slos.items())
