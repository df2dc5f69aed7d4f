"""`mili bench serve` end to end: the SSE client's timings and failures against a fake timed server, the
CLI with its table and JSON, and one run against a real `mili serve` on the tiny checkpoint (datasets,
request bodies and the summary math have their own files)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from bench_helpers import FAKE_MODEL, ITL_S, TTFT_S, fake_openai_app, serve_in_thread, write_sharegpt

from mili_openai.bench.cli import EXIT_FAILED_REQUESTS, EXIT_OK, main
from mili_openai.bench.config import BenchConfig
from mili_openai.bench.runner import run_benchmark
from mili_openai.bench.server_process import ServerProcess, ServerSpec, free_port
from mili_openai.bench.sse_client import SOURCE_CHUNKS, SOURCE_USAGE


def test_client_timings_against_fake_server(bench_tokenizer):
    output_len, requests, concurrency = 10, 8, 4
    with serve_in_thread(fake_openai_app()) as base_url:
        config = BenchConfig(base_url=base_url, num_requests=requests, concurrency=concurrency, input_len=16,
                             output_len=output_len, progress=False, warmup=1)
        began = time.perf_counter()
        run = asyncio.run(run_benchmark(config, bench_tokenizer))
        wall_s = time.perf_counter() - began  # the whole run, warm-up included, as this test saw it
    s = run.summary
    assert run.model == FAKE_MODEL and run.warmup_failed == 0
    assert (s.completed, s.failed) == (requests, 0)
    assert s.output_tokens_source == SOURCE_USAGE and s.total_output_tokens == requests * output_len
    assert s.total_input_tokens == requests * 11  # usage's prompt_tokens wins over the dataset's count
    ideal_e2e = TTFT_S + (output_len - 1) * ITL_S
    # Only what holds however busy the machine is: the server's sleeps never end early, so a request's first
    # token and its end come no sooner than the server put them; a part of a request lies within the
    # longest request, a request within the run, the run within the wall time this test measured around it;
    # and each request's TTFT plus its output tokens' TPOT is its E2E. A unit slip breaks one of these.
    longest_s = max(r.e2e_s for r in run.results)
    assert TTFT_S <= s.ttft.p50_ms / 1000 <= longest_s
    assert 0 < s.itl.p50_ms / 1000 <= longest_s
    assert s.ttft.mean_ms + (output_len - 1) * s.tpot.mean_ms == pytest.approx(s.e2e.mean_ms)
    assert ideal_e2e <= s.e2e.mean_ms / 1000 <= s.duration_s
    waves = requests // concurrency  # the cap makes the requests run in two waves
    assert waves * ideal_e2e <= s.duration_s <= wall_s
    assert s.request_throughput == pytest.approx(requests / s.duration_s)
    starts = sorted(r.start_s for r in run.results)
    first_finish = min(r.start_s + r.e2e_s for r in run.results)
    # the first wave is sent before any request finishes, the 5th only once one has
    assert starts[concurrency - 1] < first_finish <= starts[concurrency] and ideal_e2e <= first_finish


def test_models_spread_the_requests_round_robin(bench_tokenizer):
    names = ("a", "b", "c")
    app = fake_openai_app(first_delay_s=0.0, served=names)
    with serve_in_thread(app) as base_url:
        config = BenchConfig(base_url=base_url, num_requests=6, input_len=8, output_len=2, progress=False, warmup=3,
                             models=names)
        run = asyncio.run(run_benchmark(config, bench_tokenizer))
    assert run.summary.completed == 6 and run.model == "a,b,c"
    assert sorted(app.state.models_asked) == sorted(names * 3)  # the warm-up's three, then two rounds


def test_failures_counted_and_reported(bench_tokenizer):
    with serve_in_thread(fake_openai_app(fail_every=2)) as base_url:
        config = BenchConfig(base_url=base_url, num_requests=8, input_len=8, output_len=4, progress=False)
        run = asyncio.run(run_benchmark(config, bench_tokenizer))
    assert (run.summary.completed, run.summary.failed) == (4, 4)
    assert any("HTTP 500" in e and "injected failure" in e for e in run.summary.errors)
    assert any("injected stream error" in e for e in run.summary.errors)
    assert run.summary.total_output_tokens == 4 * 4


# the server holds its first token longer than any test runs, so a run that ends at all ended on its own
# timeouts; the guard only stops a broken run from hanging the suite
SERVER_HOLD_S = 3600.0
RUN_GUARD_S = 300.0


def test_timeout_is_a_failure_and_the_run_ends(bench_tokenizer):
    with serve_in_thread(fake_openai_app(first_delay_s=SERVER_HOLD_S)) as base_url:
        config = BenchConfig(base_url=base_url, model=FAKE_MODEL, num_requests=2, input_len=4, output_len=2,
                             timeout_s=0.3, progress=False)
        run = asyncio.run(asyncio.wait_for(run_benchmark(config, bench_tokenizer), RUN_GUARD_S))
    assert run.summary.failed == 2 and "timeout after 0.3 s" in run.summary.errors[0]


def test_cli_chat_without_usage_counts_chunks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "res" / "bench.json"
    with serve_in_thread(fake_openai_app(send_usage=False)) as base_url:
        code = main(["serve", "--base-url", base_url, "--endpoint", "chat", "--dataset", "shared-prefix",
                     "--num-requests", "4", "--num-groups", "2", "--prefix-len", "32", "--suffix-len", "8",
                     "--output-len", "5", "--request-rate", "50", "--json", str(out), "--no-progress"])
    assert code == EXIT_OK
    table = capsys.readouterr().out
    assert "Completed requests" in table and "from chunks" in table and "P99 TPOT (ms)" in table
    data = json.loads(out.read_text())
    assert data["config"]["endpoint"] == "chat" and data["config"]["request_rate"] == 50.0
    assert data["summary"]["completed"] == 4 and data["summary"]["output_tokens_source"] == SOURCE_CHUNKS
    assert data["summary"]["total_output_tokens"] == 20 and len(data["requests"]) == 4
    assert data["summary"]["ttft"]["p50_ms"] >= TTFT_S * 1000


def test_cli_bursty_arrivals_drawn_lengths_goodput_and_percentiles(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with serve_in_thread(fake_openai_app()) as base_url:
        code = main(["serve", "--base-url", base_url, "--num-requests", "12", "--input-len", "16",
                     "--output-len", "4", "--random-range-ratio", "0.5", "--request-rate", "200",
                     "--burstiness", "0.5", "--goodput", "ttft:60000", "e2el:60000", "--json", str(out),
                     "--metric-percentiles", "50,90", "--no-progress"])
    assert code == EXIT_OK, capsys.readouterr().err
    table = capsys.readouterr().out
    assert "burstiness 0.5" in table and "lengths within ±0.5" in table
    data = json.loads(out.read_text())
    assert data["config"]["burstiness"] == 0.5 and data["config"]["random_range_ratio"] == 0.5
    outputs = [r["output_tokens"] for r in data["requests"]]
    assert all(2 <= n <= 6 for n in outputs) and len(set(outputs)) > 1  # each request's own max_tokens
    assert data["summary"]["total_output_tokens"] == sum(outputs)
    # every request is well within a minute: goodput is the request throughput
    assert data["config"]["goodput_slos"] == {"ttft": 60000.0, "e2el": 60000.0}
    assert data["summary"]["request_goodput"] == pytest.approx(data["summary"]["request_throughput"])
    assert "ttft <= 60000 ms, e2el <= 60000 ms" in table
    assert "P90 TTFT (ms)" in table and "P99 TTFT (ms)" not in table
    assert set(data["summary"]["ttft"]["percentiles_ms"]) == {"p50", "p90"}


def test_cli_sharegpt_against_fake_server(tmp_path, capsys):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path)
    out = tmp_path / "bench.json"
    with serve_in_thread(fake_openai_app()) as base_url:
        code = main(["serve", "--base-url", base_url, "--dataset", "sharegpt", "--dataset-path", str(path),
                     "--num-requests", "4", "--sharegpt-output-len", "3", "--json", str(out), "--no-progress"])
    assert code == EXIT_OK, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["config"]["dataset"] == "sharegpt" and data["summary"]["completed"] == 4
    assert data["summary"]["total_output_tokens"] == 4 * 3


def test_cli_exit_codes(capsys):
    with serve_in_thread(fake_openai_app(fail_every=1)) as base_url:
        code = main(["serve", "--base-url", base_url, "--num-requests", "2", "--input-len", "4",
                     "--output-len", "2", "--no-progress"])
    assert code == EXIT_FAILED_REQUESTS and "Failed requests" in capsys.readouterr().out
    assert main(["serve", "--num-requests", "0", "--no-progress"]) == 2
    assert main(["serve", "--goodput", "itl:5", "--no-progress"]) == 2  # not one of vLLM's goodput metrics
    assert "goodput metric" in capsys.readouterr().err


# ---- end to end against the real server ----
def test_bench_against_real_mili_serve(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint
    port = free_port()
    spec = ServerSpec(name="mili", base_url=f"http://127.0.0.1:{port}",
                      argv=(sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--host", "127.0.0.1",
                            "--port", str(port), "--dtype", "float32", "--num-pages", "64"))
    out = tmp_path / "bench.json"
    with ServerProcess(spec, tmp_path / "mili.log") as server:
        server.wait_healthy(timeout_s=120)
        code = main(["serve", "--base-url", spec.base_url, "--num-requests", "4", "--concurrency", "2",
                     "--input-len", "24", "--output-len", "6", "--ignore-eos", "--json", str(out),
                     "--no-progress"])
        assert code == EXIT_OK, server.log_tail()
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 4 and summary["output_tokens_source"] == SOURCE_USAGE
    assert summary["total_output_tokens"] == 4 * 6  # ignore_eos: every request runs to max_tokens
    assert summary["ttft"]["count"] == 4
