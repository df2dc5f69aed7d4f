"""Profiling a serving engine: `mili serve --torch-profiler-dir DIR` with `POST /start_profile` and
`POST /stop_profile`, as real `mili serve` child processes on the tiny checkpoint, the engine in the server's
process and in a process of its own (`--engine-process`, with `--async-launch` as on CUDA).

Started, a profile records the engine's steps while completions run; stopped, it writes a gzipped Chrome
trace and a summary naming the model's ops into DIR and answers their paths. A stream in flight when the
profile stops ends whole. A second start, or a stop with none running, is a 409; without the flag both
routes are 404s in OpenAI's shape. `mili bench serve --profile` wraps its measured requests in a profile
and prints where the files went.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers_server import REAL_SERVE_FLAGS, asgi_client, mili_serve_process, sdk_client
from mili_openai.bench.cli import EXIT_OK, main as bench_main
from mili_openai.bench.server_process import ServerProcess

MODEL = "tiny-profiled"
START_TIMEOUT_S = 180.0  # torch imports and the load on a busy 2-core machine (twice with an engine process)
HTTP_TIMEOUT_S = 120.0  # a stop writes the trace before it answers
MODEL_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul")  # one of them runs every layer's projections
STREAM_TOKENS = 48


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def profiled_server(request, tiny_checkpoint, tmp_path_factory) -> Iterator[tuple[ServerProcess, Path]]:
    work = tmp_path_factory.mktemp(f"profiled-{request.param}")
    profile_dir = work / "profiles"
    # the engine process as on CUDA: with steps launched on its loop (on the CPU the forward then runs there)
    layout = ("--engine-process", "--async-launch") if request.param == "engine-process" else ("--no-engine-process",)
    with mili_serve_process("mili-profiled", tiny_checkpoint, work / "server.log", *REAL_SERVE_FLAGS, *layout,
                            "--served-model-name", MODEL, "--torch-profiler-dir", str(profile_dir)) as server:
        server.wait_healthy(START_TIMEOUT_S)
        yield server, profile_dir


def post(base_url: str, path: str) -> httpx.Response:
    return httpx.post(base_url + path, timeout=HTTP_TIMEOUT_S)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]


def test_start_completions_stop_writes_a_trace_and_a_summary(profiled_server):
    server, profile_dir = profiled_server
    base_url = server.spec.base_url
    assert_openai_error(post(base_url, "/stop_profile"), 409, "profile_not_running")
    started = post(base_url, "/start_profile")
    assert started.status_code == 200, started.text
    assert started.json() == {"status": "profiling", "torch_profiler_dir": str(profile_dir)}
    assert_openai_error(post(base_url, "/start_profile"), 409, "profile_already_running")
    client = sdk_client(base_url + "/v1")
    for prompt in ("Hello there", "Count to five", "The capital of France is"):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 6
    # a stream in flight while the profile stops and writes its files still ends whole
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=STREAM_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    stopped = post(base_url, "/stop_profile")
    rest = list(chunks)
    text_chunks = [c for c in (first, *rest) if c.choices and c.choices[0].text]
    assert [c.choices[0].finish_reason for c in (first, *rest) if c.choices][-1] == "length"
    assert len(text_chunks) >= 1

    assert stopped.status_code == 200, stopped.text
    body = stopped.json()
    assert body["status"] == "stopped" and body["num_steps"] >= 3 * 6 and body["wall_s"] > 0
    assert body["gpu_busy_fraction"] is None  # on the CPU
    trace, summary = Path(body["trace"]), Path(body["summary"])
    assert trace.parent == profile_dir and trace.name.endswith(".pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {event.get("name") for event in events}
    assert any(op in names for op in MODEL_OPS), sorted(n for n in names if n and n.startswith("aten::"))[:30]
    assert "mili::postprocess" in names and names & {"mili::execute", "mili::launch"}  # each step's ranges
    text = summary.read_text()
    assert f"engine steps recorded: {body['num_steps']}" in text
    assert "## operators by host time" in text and any(op in text for op in MODEL_OPS)
    assert_openai_error(post(base_url, "/stop_profile"), 409, "profile_not_running")

    # profiling again writes new files beside the first
    assert post(base_url, "/start_profile").status_code == 200
    client.completions.create(model=MODEL, prompt="Again", max_tokens=2, temperature=0)
    second = post(base_url, "/stop_profile").json()
    assert second["trace"] != body["trace"] and Path(second["summary"]).exists()


def test_bench_serve_profile_prints_where_the_files_went(profiled_server, tmp_path, capsys):
    server, profile_dir = profiled_server
    out = tmp_path / "bench.json"
    code = bench_main(["serve", "--base-url", server.spec.base_url, "--num-requests", "3", "--concurrency", "2",
                       "--input-len", "16", "--output-len", "4", "--ignore-eos", "--no-progress", "--profile",
                       "--json", str(out)])
    printed = capsys.readouterr()
    assert code == EXIT_OK, printed.err
    profile = json.loads(out.read_text())["profile"]
    assert profile["status"] == "stopped" and profile["num_steps"] >= 4
    assert Path(profile["trace"]).parent == profile_dir and Path(profile["summary"]).exists()
    assert f"trace {profile['trace']}, summary {profile['summary']}" in printed.out


def test_bench_serve_profile_against_a_server_without_the_flag_says_why(qwen_tokenizer, tmp_path, capsys):
    from bench_helpers import fake_openai_app, serve_in_thread

    with serve_in_thread(fake_openai_app()) as base_url:
        code = bench_main(["serve", "--base-url", base_url, "--num-requests", "1", "--input-len", "8",
                           "--output-len", "2", "--no-progress", "--profile"])
    assert code != EXIT_OK
    assert "/start_profile answered 404" in capsys.readouterr().err


@pytest.mark.anyio
async def test_without_the_flag_the_routes_are_404s_saying_how_to_enable_them(fake_engine):
    async with asgi_client(fake_engine) as client:
        for path in ("/start_profile", "/stop_profile"):
            response = await client.post(path)
            assert_openai_error(response, 404, "profiler_disabled")
            assert "--torch-profiler-dir" in response.json()["error"]["message"]
