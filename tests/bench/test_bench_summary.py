"""`mili bench serve`'s numbers: percentiles, the summary of request results, Poisson arrivals, and the
comparison tables and server processes that scripts/compare_serving.py builds on."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from mili_openai.bench.config import BenchConfig, parse_goodput, parse_percentiles
from mili_openai.bench.runner import arrival_times
from mili_openai.bench.sse_client import SOURCE_CHUNKS, SOURCE_USAGE, RequestResult
from mili_openai.bench.summary import percentile, summarize


# ---- math ----
def test_percentile_known_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summarize_known_results():
    ok = [RequestResult(success=True, prompt_len=10, output_tokens=5, output_tokens_source=SOURCE_USAGE,
                        ttft_s=0.1 * (i + 1), e2e_s=0.1 * (i + 1) + 0.4, itl_s=[0.1] * 4) for i in range(3)]
    bad = RequestResult(success=False, error="HTTP 500: boom")
    summary = summarize(ok + [bad, RequestResult(success=False, error="HTTP 500: boom")], 2.0, 5)
    assert (summary.completed, summary.failed) == (3, 2)
    assert summary.total_input_tokens == 30 and summary.total_output_tokens == 15
    assert summary.request_throughput == 1.5 and summary.output_throughput == 7.5
    assert summary.input_throughput == 15.0 and summary.total_token_throughput == 22.5
    assert summary.ttft.mean_ms == pytest.approx(200.0) and summary.ttft.p50_ms == pytest.approx(200.0)
    assert summary.tpot.mean_ms == pytest.approx(100.0)  # (e2e - ttft) / (5 - 1) = 0.4 / 4
    assert summary.itl.count == 12 and summary.itl.p99_ms == pytest.approx(100.0)
    assert summary.e2e.p50_ms == pytest.approx(600.0)
    assert summary.errors == ["HTTP 500: boom (x2)"]
    assert summary.output_tokens_source == SOURCE_USAGE


def test_goodput_counts_completed_requests_within_every_bound():
    def done(ttft_s, e2e_s, tokens):
        return RequestResult(success=True, prompt_len=1, output_tokens=tokens, output_tokens_source=SOURCE_USAGE,
                             ttft_s=ttft_s, e2e_s=e2e_s)
    results = [done(0.1, 0.5, 5),  # TPOT 100 ms
               done(0.3, 0.5, 5),  # TTFT over 200 ms
               done(0.1, 1.3, 5),  # TPOT 300 ms
               done(0.1, 0.1, 1),  # one token: no TPOT to miss
               RequestResult(success=False, error="HTTP 500")]  # failed: never counted
    assert summarize(results, 2.0, 5).request_goodput is None
    assert summarize(results, 2.0, 5, {"ttft": 200, "tpot": 150}).request_goodput == 2 / 2.0
    assert summarize(results, 2.0, 5, {"e2el": 600}).request_goodput == 3 / 2.0
    assert summarize(results, 2.0, 5, {"ttft": 50}).request_goodput == 0.0


def test_goodput_arguments():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["ttft:fast"], ["ttft:"]):
        with pytest.raises(ValueError, match="METRIC:MS"):
            parse_goodput(bad)
    for slos in ({"itl": 5.0}, {"ttft": 0.0}, {"tpot": math.inf}):
        with pytest.raises(ValueError, match="goodput"):
            BenchConfig(goodput_slos=slos)


def test_requested_percentiles_beside_p50_and_p99():
    ok = [RequestResult(success=True, prompt_len=1, output_tokens=2, output_tokens_source=SOURCE_USAGE,
                        ttft_s=0.01 * (i + 1), e2e_s=1.0, itl_s=[0.5]) for i in range(101)]  # TTFTs 10..1010 ms
    summary = summarize(ok, 1.0, 5, percentiles=(90, 99.9))
    assert summary.ttft.percentiles_ms == {"p90": pytest.approx(910.0), "p99.9": pytest.approx(1009.0)}
    assert summary.ttft.p50_ms == pytest.approx(510.0) and summary.ttft.p99_ms == pytest.approx(1000.0)
    assert summarize(ok, 1.0, 5).ttft.percentiles_ms.keys() == {"p50", "p99"}
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_percentiles("50;90")
    for bad in ((), (101,), (-1, 50)):
        with pytest.raises(ValueError, match="metric_percentiles"):
            BenchConfig(metric_percentiles=bad)


def test_summarize_single_token_outputs_have_no_tpot():
    one = RequestResult(success=True, output_tokens=1, output_tokens_source=SOURCE_CHUNKS, ttft_s=0.1, e2e_s=0.1)
    summary = summarize([one], 1.0, 5)
    assert summary.tpot.mean_ms is None and summary.tpot.count == 0
    assert summary.output_tokens_source == SOURCE_CHUNKS


def test_arrival_times():
    assert arrival_times(4, math.inf, 0) == [0.0] * 4
    times = arrival_times(4000, 20.0, 1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_times(10, 5.0, 1) == arrival_times(10, 5.0, 1)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_keep_the_rate_and_spread_by_burstiness(burstiness):
    """Gamma gaps of shape b (vLLM's --burstiness): mean 1 / rate whatever b, and a coefficient of
    variation of 1 / sqrt(b), so b < 1 bunches requests and b > 1 spaces them evenly."""
    times = arrival_times(20000, 10.0, 3, burstiness)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert mean == pytest.approx(0.1, rel=0.05)
    assert spread == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_times(50, 10.0, 3, burstiness) == times[:50]  # seeded
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, 0, 0.0)


def test_poisson_schedule_is_unchanged_by_the_burstiness_option():
    """burstiness 1 draws the same exponential gaps as before the option existed (reruns compare)."""
    rng = random.Random(5)
    expected, now = [], 0.0
    for _ in range(6):
        expected.append(now)
        now += rng.expovariate(2.0)
    assert arrival_times(6, 2.0, 5) == arrival_times(6, 2.0, 5, 1.0) == expected


# ---- comparison tables and the server process helper (used by scripts/compare_serving.py) ----
def test_advantage_orientation():
    from mili_openai.bench.comparison_table import HIGHER_IS_BETTER, LOWER_IS_BETTER, advantage

    assert advantage(200.0, 100.0, HIGHER_IS_BETTER) == 2.0  # twice the throughput
    assert advantage(50.0, 100.0, LOWER_IS_BETTER) == 2.0  # half the latency
    assert advantage(None, 100.0, LOWER_IS_BETTER) is None and advantage(0.0, 1.0, HIGHER_IS_BETTER) is None
    assert advantage(3.0, 1.0, None) is None


def test_render_workload_table_with_missing_server():
    from mili_openai.bench.comparison_table import METRICS, render_workload_table

    ours = summarize([RequestResult(success=True, prompt_len=4, output_tokens=3, output_tokens_source=SOURCE_USAGE,
                                    ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1])], 1.0, 5).to_json()
    peer = dict(ours, output_throughput=1.5, ttft=dict(ours["ttft"], p50_ms=300.0))
    table = render_workload_table(["mili", "peer", "absent"], {"mili": ours, "peer": peer})
    lines = table.splitlines()
    assert lines[0] == "| metric | mili | peer | absent | mili advantage vs peer (×) | mili advantage vs absent (×) |"
    assert len(lines) == 2 + len(METRICS)
    assert "| output tok/s | 3.0 | 1.5 | — | 2.00 | — |" in lines
    assert "| TTFT p50 (ms) | 100.0 | 300.0 | — | 3.00 | — |" in lines
    assert "| completed / failed | 1 / 0 | 1 / 0 | — | — | — |" in lines
    assert "| output tokens (total) | 3 (usage) | 3 (usage) | — | — | — |" in lines


def test_replace_marked_section(tmp_path):
    from mili_openai.bench.comparison_table import replace_marked_section, update_marked_file

    begin, end = "<!-- b -->", "<!-- e -->"
    assert replace_marked_section("", begin, end, "x") == f"{begin}\nx\n{end}\n"
    doc = f"# T\n\nintro\n\n{begin}\nold\n{end}\n\n## other\n"
    assert replace_marked_section(doc, begin, end, "new\n") == f"# T\n\nintro\n\n{begin}\nnew\n{end}\n\n## other\n"
    with pytest.raises(ValueError):
        replace_marked_section(f"{begin}\nonly begin", begin, end, "x")
    with pytest.raises(ValueError):
        replace_marked_section(f"{end}\n{begin}", begin, end, "x")
    path = update_marked_file(tmp_path / "docs" / "perf.md", begin, end, "one", "Perf")
    update_marked_file(path, begin, end, "two", "Perf")
    assert path.read_text() == f"# Perf\n\n{begin}\ntwo\n{end}\n"


def test_server_process_waits_for_health_and_stops(tmp_path):
    from mili_openai.bench.server_process import ServerProcess, ServerSpec, free_port

    port = free_port()
    spec = ServerSpec(name="static", base_url=f"http://127.0.0.1:{port}", health_path="/",
                      argv=(sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"))
    process = ServerProcess(spec, tmp_path / "static.log")
    with process:
        assert process.wait_healthy(timeout_s=20) < 20
    assert process.process.poll() is not None  # stopped on exit


def test_server_process_reports_early_exit(tmp_path):
    from mili_openai.bench.server_process import ServerProcess, ServerSpec

    spec = ServerSpec(name="broken", base_url="http://127.0.0.1:9", argv=(sys.executable, "-c", "print('no model')"))
    with ServerProcess(spec, tmp_path / "broken.log") as process:
        with pytest.raises(RuntimeError, match="(?s)broken exited with 0.*no model"):
            process.wait_healthy(timeout_s=20)


# ---- scripts/serving_limits.py: W3 against the floors measured around it ----
def _serving_limits():
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import serving_limits

    return serving_limits


def _limits(bandwidth: float, step_ms: float, prefill_ms_per_token: float, flops: float) -> dict:
    return {"read_bandwidth_bytes_per_s": bandwidth, "decode_step_floor_ms": step_ms,
            "prefill_floor_ms_per_token": prefill_ms_per_token, "matmul_flops_per_s": flops}


def test_paired_rounds_hold_each_request_against_the_stricter_floor_around_it():
    limits = _serving_limits()
    slow, fast = _limits(30e9, 40.0, 2.0, 300e9), _limits(60e9, 20.0, 2.5, 400e9)
    stricter = limits.strictest({"before": slow, "after": fast})
    assert stricter["decode_step_floor_ms"] == 20.0  # the faster read, so the lower floor
    assert stricter["prefill_floor_ms_per_token"] == 2.0 and stricter["matmul_flops_per_s"] == 400e9

    def summary(tpot, ttft):
        return {"tpot": {"mean_ms": tpot}, "ttft": {"mean_ms": ttft}}

    rounds = [{"before": slow, "after": slow, "summary": summary(50.0, 1000.0)},
              {"before": fast, "after": slow, "summary": summary(25.0, 800.0)},
              {"before": slow, "after": slow, "summary": summary(None, None)}]  # a failed request
    fractions = limits.paired_fractions(rounds, prompt_len=400)
    assert fractions["decode"] == pytest.approx([0.8, 0.8])
    assert fractions["prefill"] == pytest.approx([0.8, 1.0])
    assert limits.spread_text([0.8, 0.8]).startswith("median 80% ")
    assert limits.spread_text([]) == "no round completed"
    lines = limits.render_paired("2 requests", {"mili": rounds}, prompt_len=400)
    assert any(line.startswith("- mili: decode median 80%") for line in lines)
