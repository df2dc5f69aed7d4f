"""`mili serve --tensor-parallel-size 2` on CPU (two gloo worker processes), as a real child process:
the chat tests of test_chat_server.py pass against it unchanged, completions give one rank's greedy
tokens, and a worker killed mid-request takes the server down with a non-zero exit and a clear log line,
within 30 s, while the stream in flight ends with an error event."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import openai
import pytest

from helpers_server import (
    REAL_SERVE_FLAGS,
    check_greedy_completions_match_offline,
    interrupted_stream,
    mili_serve_process,
    stream_error_messages,
)
from mili_openai.bench.server_process import ServerProcess
from test_chat_server import (  # noqa: F401  (collected here too: run against the tensor-parallel server)
    MODEL,
    test_async_client_streams_and_answers,
    test_context_overflow_is_a_400_with_the_numbers,
    test_greedy_stream_equals_the_whole_response,
    test_logprobs_agree_with_greedy_choice,
    test_n_choices_with_a_seed_are_reproducible,
    test_stop_string_cuts_the_content_before_it,
    test_tool_call_forced_through_the_real_model,
)

TENSOR_PARALLEL_SIZE = 2
START_TIMEOUT_S = 180.0  # two worker processes import torch and load on a busy 2-core machine
EXIT_DEADLINE_S = 30.0  # the bound from a rank's death to the server's exit
KILLED_STREAM_TOKENS = 400  # the stream a rank is killed under: still running when the kill lands
# the engine settings the chat tests were written for (REAL_SERVE_FLAGS: their 512-token context)
SERVE_FLAGS = (*REAL_SERVE_FLAGS, "--tensor-parallel-size", str(TENSOR_PARALLEL_SIZE), "--served-model-name", MODEL)
READY_LINE = re.compile(r"tensor-parallel rank (\d+) of \d+ ready \(pid (\d+)\)")


def tp_server_process(checkpoint, log_path) -> ServerProcess:
    """`mili serve` with two ranks, not started yet (a context manager: started, then stopped)."""
    return mili_serve_process("mili-tp", checkpoint, log_path, *SERVE_FLAGS)


def worker_pids(server: ServerProcess) -> dict[int, int]:
    return {int(rank): int(pid) for rank, pid in READY_LINE.findall(server.log_tail())}


@pytest.fixture(scope="module")
def tp_server(tiny_checkpoint, tmp_path_factory) -> Iterator[ServerProcess]:
    with tp_server_process(tiny_checkpoint, tmp_path_factory.mktemp("tp-server") / "server.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        assert sorted(worker_pids(server)) == list(range(TENSOR_PARALLEL_SIZE))
        yield server


@pytest.fixture(scope="module")
def api_base(tp_server) -> str:  # conftest's `client` is the SDK on it
    return tp_server.spec.base_url + "/v1"


def test_greedy_completions_match_one_rank(client, tiny_checkpoint):
    check_greedy_completions_match_offline(client, MODEL, tiny_checkpoint)


def test_completion_logprobs_and_bad_input(client):
    result = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, logprobs=2,
                                       n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1] and result.choices[0].text == result.choices[1].text
    assert all(len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) == 2 for c in result.choices)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=-1)


def test_a_worker_killed_mid_request_stops_the_server(tiny_checkpoint, tmp_path):
    with tp_server_process(tiny_checkpoint, tmp_path / "server.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        pids = worker_pids(server)
        payloads = interrupted_stream(server.spec.base_url, MODEL, lambda: os.kill(pids[1], signal.SIGKILL),
                                      KILLED_STREAM_TOKENS)
        code = server.process.wait(timeout=EXIT_DEADLINE_S)
    assert code != 0
    log = server.log_tail()
    assert f"tensor-parallel rank 1 (pid {pids[1]}) was killed by signal 9 (SIGKILL)" in log
    assert "exiting: the engine cannot continue" in log
    errors = stream_error_messages(payloads)
    assert errors and "tensor-parallel rank 1" in errors[0]
    with pytest.raises(ProcessLookupError):  # the other rank went with it
        os.kill(pids[0], 0)
