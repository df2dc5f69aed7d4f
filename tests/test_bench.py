"""`mili bench serve`: datasets, request bodies, the SSE client against a fake timed server, the CLI +
JSON, and one end-to-end run against a real `mili serve` on the tiny checkpoint (summary math and the
comparison tables are in test_bench_summary)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mili_openai.bench.cli import EXIT_FAILED_REQUESTS, EXIT_OK, main
from mili_openai.bench.config import BenchConfig, length_range
from mili_openai.bench.datasets import (
    build_random_requests,
    build_shared_prefix_requests,
    build_sharegpt_requests,
    build_workload,
)
from mili_openai.bench.payloads import request_body
from mili_openai.bench.prompt_tokens import PromptBuilder, load_tokenizer
from mili_openai.bench.runner import run_benchmark
from mili_openai.bench.sse_client import SOURCE_CHUNKS, SOURCE_USAGE

FAKE_MODEL = "fake-model"
TTFT_S = 0.15  # the fake server's delay before the first token
ITL_S = 0.02  # and between tokens
SERVER_START_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# ---- prompts and datasets ----
@pytest.mark.parametrize("length", [1, 7, 256, 960])
def test_text_prompts_retokenize_to_requested_length(tokenizer, length):
    builder = PromptBuilder(tokenizer, seed=length)
    for _ in range(3):
        prompt = builder.prompt(length)
        retokenized = tokenizer.encode(prompt.text, add_special_tokens=False).ids
        assert abs(len(retokenized) - length) <= 1
        assert list(prompt.token_ids) == retokenized


def test_prompts_use_normal_vocab_only_and_differ(tokenizer):
    builder = PromptBuilder(tokenizer, seed=0)
    normal_size = tokenizer.get_vocab_size(with_added_tokens=False)
    prompts = [builder.id_prompt(64) for _ in range(4)]
    assert all(len(p.token_ids) == 64 and max(p.token_ids) < normal_size for p in prompts)
    assert len({p.token_ids for p in prompts}) == 4


def test_same_seed_same_prompts(tokenizer):
    first = PromptBuilder(tokenizer, seed=3).prompt(32)
    assert PromptBuilder(tokenizer, seed=3).prompt(32) == first
    assert PromptBuilder(tokenizer, seed=4).prompt(32) != first


def test_random_dataset_lengths(tokenizer):
    requests = build_random_requests(PromptBuilder(tokenizer, 0), 5, input_len=100, output_len=9)
    assert len(requests) == 5
    assert all(abs(r.prompt_len - 100) <= 1 and r.output_len == 9 and r.prefix is None for r in requests)


def test_random_range_ratio_draws_lengths_within_bounds(tokenizer):
    requests = build_random_requests(PromptBuilder(tokenizer, 0), 40, input_len=40, output_len=10,
                                     range_ratio=0.5)
    prompt_lens, output_lens = [r.prompt_len for r in requests], [r.output_len for r in requests]
    assert all(20 - 1 <= n <= 60 + 1 for n in prompt_lens) and all(5 <= n <= 15 for n in output_lens)
    assert len(set(prompt_lens)) > 5 and len(set(output_lens)) > 3  # drawn, not fixed
    again = build_random_requests(PromptBuilder(tokenizer, 0), 40, input_len=40, output_len=10, range_ratio=0.5)
    assert again == requests  # seeded
    # at 0 no length is drawn: the prompts are those of a run without the option
    plain = build_random_requests(PromptBuilder(tokenizer, 0), 3, input_len=12, output_len=4)
    assert build_random_requests(PromptBuilder(tokenizer, 0), 3, input_len=12, output_len=4, range_ratio=0) == plain


def test_length_range_bounds():
    assert length_range(100, 0.1) == (90, 110)  # not 111: 100 * 1.1 is not exact in floats
    assert length_range(64, 0.5) == (32, 96)
    assert length_range(1, 0.9) == (1, 2)
    assert length_range(7, 0.0) == (7, 7)


def test_shared_prefix_dataset_groups(tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(tokenizer, 0), 8, num_groups=2, prefix_len=120,
                                            suffix_len=10, output_len=4)
    assert [r.group for r in requests] == [0, 1] * 4  # round-robin: groups arrive interleaved
    assert all(r.prefix is requests[r.group].prefix for r in requests)
    assert requests[0].prefix != requests[1].prefix
    assert len({r.body for r in requests}) == 8
    config = BenchConfig(dataset="shared-prefix")
    text = request_body(config, "m", requests[0])["prompt"]
    assert text.startswith(requests[0].prefix.text)
    assert abs(len(tokenizer.encode(text, add_special_tokens=False).ids) - 130) <= 1


def test_shared_prefix_rejects_more_groups_than_requests(tokenizer):
    with pytest.raises(ValueError, match="num_groups"):
        build_shared_prefix_requests(PromptBuilder(tokenizer, 0), 2, num_groups=3, prefix_len=4, suffix_len=4,
                                     output_len=1)


def test_warmup_prompts_are_not_measured_prompts(tokenizer):
    config = BenchConfig(num_requests=3, warmup=2, input_len=16)
    warmup, measured = build_workload(config, tokenizer)
    assert len(warmup) == 2 and len(measured) == 3
    assert not {r.body for r in warmup} & {r.body for r in measured}


SHAREGPT_KEPT = [  # (prompt, reply): each side at least 4 tokens
    ("Explain how a hash map handles collisions in a few sentences.", "It keeps a list per bucket and walks it."),
    ("Write a haiku about the sea at night, please.", "Dark water whispers under a silver moon tonight."),
    ("What is the capital of France, and why is it famous?", "Paris, famous for art, food and its history."),
    ("Summarise the plot of Hamlet in two short lines.", "A prince avenges his father, and nearly all die."),
]


def write_sharegpt(path) -> None:
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
               for i, (p, r) in enumerate(SHAREGPT_KEPT)]
    entries += [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "Only a question with no reply here"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "long", "conversations": [{"from": "human", "value": " word" * 1100},
                                         {"from": "gpt", "value": "A reply long enough to count."}]},
        "not a conversation",
    ]
    path.write_text(json.dumps(entries))


def test_sharegpt_dataset_reads_conversations_as_vllm_does(tokenizer, tmp_path):
    """First turn = prompt, the reply's token count = max_tokens; entries vLLM skips are skipped; a seed
    gives one order; asking for more than the file holds is an error."""
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path)
    requests = build_sharegpt_requests(PromptBuilder(tokenizer, 0), 4, path)
    assert sorted(r.body.text for r in requests) == sorted(p for p, _ in SHAREGPT_KEPT)
    replies = dict(SHAREGPT_KEPT)
    for request in requests:
        assert request.output_len == len(tokenizer.encode(replies[request.body.text], add_special_tokens=False).ids)
        assert list(request.body.token_ids) == tokenizer.encode(request.body.text, add_special_tokens=False).ids
    again = build_sharegpt_requests(PromptBuilder(tokenizer, 0), 4, path)
    assert [r.body for r in again] == [r.body for r in requests]
    fixed = build_sharegpt_requests(PromptBuilder(tokenizer, 0), 2, path, output_len=7)
    assert [r.output_len for r in fixed] == [7, 7]
    with pytest.raises(ValueError, match="4 usable conversations"):
        build_sharegpt_requests(PromptBuilder(tokenizer, 0), 5, path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        build_sharegpt_requests(PromptBuilder(tokenizer, 0), 1, tmp_path / "bad.json")


def test_sharegpt_warmup_conversations_are_not_measured(tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path)
    config = BenchConfig(dataset="sharegpt", dataset_path=str(path), num_requests=3, warmup=1)
    warmup, measured = build_workload(config, tokenizer)
    assert len(warmup) == 1 and len(measured) == 3
    assert not {r.body for r in warmup} & {r.body for r in measured}


# ---- request bodies ----
def test_chat_body_uses_system_message_for_prefix(tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(tokenizer, 0), 2, 1, 20, 5, 3)
    body = request_body(BenchConfig(endpoint="chat"), "m", requests[1])
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == requests[1].prefix.text
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body and "min_tokens" not in body and "prompt" not in body


def test_body_options_ids_ignore_eos_extra_body(tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(tokenizer, 0), 1, 1, 20, 5, 3, as_ids=True)
    config = BenchConfig(prompt_as_ids=True, ignore_eos=True, min_tokens=2,
                         extra_body='{"generation_config": "{}", "temperature": 0.5}')
    body = request_body(config, "m", requests[0])
    assert body["prompt"] == list(requests[0].prefix.token_ids) + list(requests[0].body.token_ids)
    assert body["ignore_eos"] is True and body["min_tokens"] == 2
    assert body["generation_config"] == "{}" and body["temperature"] == 0.5
    assert body["max_tokens"] == 3


@pytest.mark.parametrize("kwargs", [
    dict(endpoint="embeddings"), dict(dataset="sharegpt"), dict(num_requests=0), dict(concurrency=0),
    dict(request_rate=0.0), dict(request_rate=math.nan), dict(endpoint="chat", prompt_as_ids=True),
    dict(extra_body="[1]"), dict(extra_body="{bad"), dict(timeout_s=0), dict(base_url="localhost:8000"),
    dict(min_tokens=65, output_len=64), dict(dataset_path="conversations.json"),
    dict(dataset="sharegpt", dataset_path="c.json", sharegpt_output_len=0),
    dict(burstiness=0), dict(burstiness=math.inf), dict(random_range_ratio=1.0), dict(random_range_ratio=-0.1),
    dict(min_tokens=40, output_len=64, random_range_ratio=0.5),  # a drawn max_tokens may be 32
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**kwargs)


def test_config_json_hides_api_key_and_spells_inf():
    data = BenchConfig(api_key="secret").to_json()
    assert data["api_key"] == "***" and data["request_rate"] == "inf"
    json.dumps(data)  # strictly JSON-serialisable


# ---- a fake OpenAI-compatible streaming server with known delays ----
def fake_openai_app(fail_every: int = 0, send_usage: bool = True, first_delay_s: float = TTFT_S) -> Starlette:
    """Streams `max_tokens` one-word chunks: the first after `first_delay_s`, the next ITL_S apart.
    Every `fail_every`-th request gets a 500 (odd ones) or an in-stream error event (even ones)."""
    counter = {"n": 0}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    async def generate(request: Request):
        body = await request.json()
        counter["n"] += 1
        number = counter["n"]
        chat = request.url.path.endswith("/chat/completions")
        failing = fail_every and number % fail_every == 0
        if failing and (number // fail_every) % 2 == 1:
            return JSONResponse({"error": {"message": f"injected failure {number}"}}, status_code=500)
        assert body["stream"] is True and body["model"] == FAKE_MODEL  # the fake's own sanity check

        def chunk(text: str | None, usage: dict | None = None, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text or "", "finish_reason": finish})
            return "data: " + json.dumps({"choices": [] if usage else [choice], "usage": usage}) + "\n\n"

        async def events():
            await asyncio.sleep(first_delay_s)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(ITL_S)
                if failing and i == 1:
                    yield 'data: {"error": {"message": "injected stream error"}}\n\n'
                    return
                yield chunk(" word", finish="length" if i == body["max_tokens"] - 1 else None)
            if send_usage:
                yield chunk(None, usage={"prompt_tokens": 11, "completion_tokens": body["max_tokens"],
                                         "total_tokens": 11 + body["max_tokens"]})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


@contextlib.contextmanager
def serve_in_thread(app: Starlette) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(SERVER_START_TIMEOUT_S)
        sock.close()


def test_client_timings_against_fake_server(tokenizer):
    output_len, requests, concurrency = 10, 8, 4
    with serve_in_thread(fake_openai_app()) as base_url:
        config = BenchConfig(base_url=base_url, num_requests=requests, concurrency=concurrency, input_len=16,
                             output_len=output_len, progress=False, warmup=1)
        run = asyncio.run(run_benchmark(config, tokenizer))
    s = run.summary
    assert run.model == FAKE_MODEL and run.warmup_failed == 0
    assert (s.completed, s.failed) == (requests, 0)
    assert s.output_tokens_source == SOURCE_USAGE and s.total_output_tokens == requests * output_len
    assert s.total_input_tokens == requests * 11  # usage's prompt_tokens wins over the dataset's count
    ideal_e2e = TTFT_S + (output_len - 1) * ITL_S
    # Lower bounds are exact (sleeps never end early); upper bounds leave room for a busy 2-core machine
    # while still catching unit slips (ms vs s) and counting errors.
    assert TTFT_S <= s.ttft.p50_ms / 1000 < TTFT_S + 0.3
    assert ITL_S * 0.9 <= s.tpot.mean_ms / 1000 < 2 * ITL_S
    assert ITL_S * 0.9 <= s.itl.p50_ms / 1000 < 2 * ITL_S
    assert ideal_e2e <= s.e2e.mean_ms / 1000 < ideal_e2e + 0.5
    waves = requests // concurrency  # the cap makes the requests run in two waves
    assert waves * ideal_e2e <= s.duration_s < waves * ideal_e2e + 1.0
    assert s.request_throughput == pytest.approx(requests / s.duration_s)
    starts = sorted(r.start_s for r in run.results)
    assert starts[concurrency - 1] < ideal_e2e <= starts[concurrency]  # 5th sent only once one finished


def test_failures_counted_and_reported(tokenizer):
    with serve_in_thread(fake_openai_app(fail_every=2)) as base_url:
        config = BenchConfig(base_url=base_url, num_requests=8, input_len=8, output_len=4, progress=False)
        run = asyncio.run(run_benchmark(config, tokenizer))
    assert (run.summary.completed, run.summary.failed) == (4, 4)
    assert any("HTTP 500" in e and "injected failure" in e for e in run.summary.errors)
    assert any("injected stream error" in e for e in run.summary.errors)
    assert run.summary.total_output_tokens == 4 * 4


def test_timeout_is_a_failure_and_the_run_ends(tokenizer):
    with serve_in_thread(fake_openai_app(first_delay_s=30.0)) as base_url:
        config = BenchConfig(base_url=base_url, model=FAKE_MODEL, num_requests=2, input_len=4, output_len=2,
                             timeout_s=0.3, progress=False)
        started = time.monotonic()
        run = asyncio.run(run_benchmark(config, tokenizer))
    assert time.monotonic() - started < 5
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
def test_bench_against_real_mili_serve(request, tmp_path):
    import importlib.util

    from mili_openai.bench.server_process import ServerProcess, ServerSpec, free_port

    if importlib.util.find_spec("mili_openai.cli") is None or importlib.util.find_spec("mili_openai.__main__") is None:
        pytest.skip("`python -m mili_openai serve` does not exist yet")
    try:
        checkpoint = request.getfixturevalue("tiny_checkpoint")
    except pytest.FixtureLookupError:
        pytest.skip("the tiny_checkpoint fixture does not exist yet")
    port = free_port()
    spec = ServerSpec(name="mili", base_url=f"http://127.0.0.1:{port}",
                      argv=(sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--host", "127.0.0.1",
                            "--port", str(port), "--dtype", "float32"))
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
