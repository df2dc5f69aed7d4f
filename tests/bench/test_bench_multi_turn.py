"""`mili bench serve --dataset multi-turn`: conversations whose every turn resends the whole history with the
server's own replies; the share of prompt tokens the server reports cached from turn 2 on; mili's state-snapshot
memory read from /metrics. Against the fake timed server, then against the real server on a tiny Qwen3.5."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from bench_helpers import FAKE_PROMPT_TOKENS, fake_openai_app, serve_in_thread
from helpers_server import served_engine

from mili_openai.bench.cli import EXIT_OK, main
from mili_openai.bench.config import BenchConfig
from mili_openai.bench.datasets import BenchRequest, build_workload
from mili_openai.bench.prompt_tokens import TokenPrompt
from mili_openai.bench.runner import run_benchmark
from mili_openai.bench.server_metrics import snapshot_memory
from mili_openai.bench.sse_client import _StreamState, request_body

FAKE_REPLY_WORD = " word"  # the fake server's every chunk
REAL_SERVER_PAGES, REAL_SERVER_PAGE_SIZE = 128, 8


def test_conversations_are_seeded_and_apart_from_warmup(bench_tokenizer):
    config = BenchConfig(dataset="multi-turn", num_conversations=3, num_turns=4, turn_len=20, output_len=5, warmup=2)
    warmup, conversations = build_workload(config, bench_tokenizer)
    assert len(conversations) == 3 and all(len(c.messages) == 4 and c.output_len == 5 for c in conversations)
    assert all(abs(m.num_tokens - 20) <= 1 for c in conversations for m in c.messages)
    assert len({m for c in conversations for m in c.messages}) == 12
    assert len(warmup) == 2 and not {r.body for r in warmup} & {m for c in conversations for m in c.messages}
    assert build_workload(config, bench_tokenizer)[1] == conversations


def test_a_turn_resends_the_history_on_both_endpoints():
    def prompt(text: str) -> TokenPrompt:
        return TokenPrompt(text=text, token_ids=tuple(range(len(text.split()))))

    history = ((prompt(" hello there"), prompt(" hi")), (prompt(" how are you"), prompt(" fine thanks")))
    request = BenchRequest(body=prompt(" and you"), output_len=4, history=history, turn=3)
    assert request.prompt_len == 2 + 1 + 3 + 2 + 2
    chat = request_body(BenchConfig(endpoint="chat", dataset="multi-turn"), "m", request)["messages"]
    assert [(m["role"], m["content"]) for m in chat] == [
        ("user", " hello there"), ("assistant", " hi"), ("user", " how are you"), ("assistant", " fine thanks"),
        ("user", " and you")]
    text = request_body(BenchConfig(dataset="multi-turn"), "m", request)["prompt"]
    assert text == " hello there hi how are you fine thanks and you"
    as_ids = request_body(BenchConfig(dataset="multi-turn", prompt_as_ids=True), "m", request)
    assert as_ids["prompt"] == [0, 1, 0, 0, 1, 2, 0, 1, 0, 1] and as_ids["return_token_ids"] is True
    assert as_ids["verbose"] is True  # llama.cpp's server returns the ids under it


def test_reply_ids_from_vllms_field_and_from_llama_cpps_verbose_field():
    """vLLM and mili stream `choices[0].token_ids`; llama.cpp's server `__verbose.tokens` (as its b1-0c1e570
    answered a `verbose` completion with a prompt of ids), and its last chunk an empty list and the usage."""
    vllm, llama = _StreamState(prompt_len=7, started=0.0), _StreamState(prompt_len=7, started=0.0)
    for step, token in enumerate([68892, 145610]):
        vllm.on_event({"choices": [{"text": "a", "index": 0, "token_ids": [token]}]}, now=step)
        llama.on_event({"choices": [{"text": "a", "index": 0, "logprobs": None, "finish_reason": None}],
                        "__verbose": {"index": 0, "content": "a", "tokens": [token], "stop": False}}, now=step)
    llama.on_event({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                    "usage": {"completion_tokens": 2, "prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}},
                    "__verbose": {"index": 0, "content": "", "tokens": [], "stop": True}}, now=2)
    assert vllm.finish(3, None).token_ids == llama.result.token_ids == [68892, 145610]
    assert llama.finish(3, None).cached_tokens == 4


def test_multi_turn_against_fake_server_counts_cached_share(bench_tokenizer):
    conversations, turns, output_len = 3, 3, 2
    bodies: list[dict] = []
    with serve_in_thread(fake_openai_app(first_delay_s=0.0, bodies=bodies)) as base_url:
        config = BenchConfig(base_url=base_url, endpoint="chat", dataset="multi-turn", num_conversations=conversations,
                             num_turns=turns, turn_len=8, output_len=output_len, concurrency=2, progress=False)
        run = asyncio.run(run_benchmark(config, bench_tokenizer))
    assert (run.summary.completed, run.summary.failed) == (conversations * turns, 0)
    # each turn came after the one before had finished, resending its reply as the assistant's message
    for first in range(0, len(run.results), turns):
        chat = run.results[first : first + turns]
        assert [r.turn for r in chat] == list(range(1, turns + 1))
        assert all(later.start_s >= earlier.start_s + earlier.e2e_s for earlier, later in zip(chat, chat[1:]))
        assert all(r.text == FAKE_REPLY_WORD * output_len for r in chat)
    longest = max(bodies, key=lambda body: len(body["messages"]))["messages"]
    assert [m["role"] for m in longest] == ["user", "assistant"] * (turns - 1) + ["user"]
    assert all(m["content"] == FAKE_REPLY_WORD * output_len for m in longest if m["role"] == "assistant")
    # the fake reports every user message but the last as cached: turns 2 and 3 give (1 + 2) / (2 + 3)
    assert run.summary.cached_prompt_share == pytest.approx(3 / 5)
    assert all(r.cached_tokens == FAKE_PROMPT_TOKENS * (r.turn - 1) for r in run.results)
    assert run.snapshot_memory is None  # the fake has no /metrics


def test_cli_multi_turn_table(tmp_path, capsys):
    with serve_in_thread(fake_openai_app(first_delay_s=0.0)) as base_url:
        code = main(["serve", "--base-url", base_url, "--dataset", "multi-turn", "--num-conversations", "2",
                     "--num-turns", "2", "--turn-len", "6", "--output-len", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == EXIT_OK and "multi-turn (2 conversations x 2 turns)" in out
    assert "Cached prompt tokens (from turn 2 on)" in out and "Completed requests                      4" in out


@pytest.mark.parametrize("kwargs", [dict(dataset="multi-turn", num_turns=0), dict(dataset="multi-turn", turn_len=0),
                                    dict(dataset="multi-turn", num_conversations=0),
                                    dict(dataset="multi-turn", endpoint="chat", prompt_as_ids=True)])
def test_config_rejects_bad_multi_turn_values(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**kwargs)


def test_snapshot_memory_from_metrics_text():
    text = ("# HELP mili_state_snapshots x\n# TYPE mili_state_snapshots gauge\nmili_state_snapshots 8.0\n"
            "mili_state_snapshots_cached 3.0\nmili_state_snapshot_bytes 8.0e+06\nmili_state_slots 4.0\n")
    assert snapshot_memory(text) == {"snapshots": 8, "cached": 3, "budget_bytes": 8_000_000, "used_bytes": 3_000_000}
    assert snapshot_memory("mili_state_snapshots 0.0\n") is None  # no snapshots: a dense model, or the cache off
    assert snapshot_memory("vllm:num_requests_running 1.0\n") is None


@pytest.fixture(scope="module")
def real_server(hybrid_checkpoint):
    """A tiny Qwen3.5 with its chat template, served for both real-server tests: their conversations share no
    prefix (one is chat-templated, the other raw ids), and the pool holds both with room to spare."""
    checkpoint = hybrid_checkpoint("qwen3_5_qwen35_tokenizer")
    with served_engine(checkpoint, num_pages=REAL_SERVER_PAGES, page_size=REAL_SERVER_PAGE_SIZE, max_model_len=512,
                       max_num_batched_tokens=64) as (live, _):
        yield live, checkpoint


def test_multi_turn_against_real_server_reuses_the_history(real_server):
    """From turn 2 on, part of every prompt is served from the prefix cache (the history up to where the template
    renders the earlier reply apart from its generated tokens), and the snapshot memory shows in the report."""
    live, checkpoint = real_server
    config = BenchConfig(base_url=live.base_url, endpoint="chat", dataset="multi-turn", num_conversations=2,
                         num_turns=3, turn_len=12, output_len=6, ignore_eos=True, progress=False,
                         tokenizer=str(Path(checkpoint)))
    run = asyncio.run(run_benchmark(config))
    assert (run.summary.completed, run.summary.failed) == (6, 0), run.summary.errors
    assert all(r.cached_tokens is not None for r in run.results)
    assert 0 < run.summary.cached_prompt_share < 1
    assert run.snapshot_memory is not None and 0 < run.snapshot_memory["cached"] <= run.snapshot_memory["snapshots"]
    assert 0 < run.snapshot_memory["used_bytes"] <= run.snapshot_memory["budget_bytes"]


def test_multi_turn_as_ids_reuses_every_earlier_turn(real_server):
    """The history resent as the ids the model saw (prompts as ids, replies from return_token_ids): from turn 2 on,
    each turn is served from the prefix cache up to the last page boundary its previous turn computed (the
    finished request's snapshot), whatever the replies' text would tokenize to."""
    live, checkpoint = real_server
    page_size, output_len = REAL_SERVER_PAGE_SIZE, 6
    config = BenchConfig(base_url=live.base_url, dataset="multi-turn", prompt_as_ids=True, num_conversations=2,
                         num_turns=3, turn_len=12, output_len=output_len, ignore_eos=True, progress=False,
                         tokenizer=str(Path(checkpoint)))
    run = asyncio.run(run_benchmark(config))
    assert (run.summary.completed, run.summary.failed) == (6, 0), run.summary.errors
    for earlier, later in zip(run.results, run.results[1:]):
        if later.turn == 1:
            continue
        assert len(later.token_ids) == output_len
        computed = earlier.prompt_len + output_len - 1  # the last generated token was never fed
        assert later.cached_tokens == computed // page_size * page_size
