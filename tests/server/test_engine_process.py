"""`mili serve --engine-process` on CPU: the engine in a process of its own behind the same routes, as a real
`mili serve` child process.

The chat tests of test_chat_server.py pass against it unchanged; greedy completions and chat equal the
in-process engine's; bad requests are 400s in OpenAI's shape and the server keeps serving; a client that
goes away frees its pages; /metrics counts the requests the engine finished (replayed from the engine
process); SIGTERM to the whole process group drains (the engine process ignores it); a killed engine process
takes the server down with a non-zero exit (a model that fails to load in it: tests/server/test_cli.py).
The frame codec the two processes speak is tested on its own at the end.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from helpers_server import (
    REAL_ENGINE_CONFIG,
    REAL_SERVE_FLAGS,
    check_greedy_completions_match_offline,
    interrupted_stream,
    mili_serve_process,
    sdk_client,
    stream_error_messages,
    wait_until,
)
from mili_openai import SamplingParams, StructuredOutputsParams, cli
from mili_openai.bench.server_process import ServerProcess
from mili_openai.engine.contract import EngineRequest
from mili_openai.engine.outputs import SequenceDelta
from mili_openai.engine.process_helpers import FRAME_HEADER, encode_frame, read_frame, recv_frame, write_frame
from mili_openai.engine.process_messages import Outputs, Submit
from test_chat_server import (  # noqa: F401  (collected here too: run against the engine-process server)
    HELLO,
    MODEL,
    test_async_client_streams_and_answers,
    test_context_overflow_is_a_400_with_the_numbers,
    test_greedy_stream_equals_the_whole_response,
    test_logprobs_agree_with_greedy_choice,
    test_n_choices_with_a_seed_are_reproducible,
    test_stop_string_cuts_the_content_before_it,
    test_tool_call_forced_through_the_real_model,
)

START_TIMEOUT_S = 180.0  # the engine process imports torch and loads on a busy 2-core machine
EXIT_TIMEOUT_S = 60.0  # generous: the bound from the engine's death to the server's exit is 30 s
PAGES_FREED_TIMEOUT_S = 60.0
SERVE_FLAGS = (*REAL_SERVE_FLAGS, "--engine-process", "--debug-endpoints", "--served-model-name", MODEL)
READY_LINE = re.compile(r"engine process \(pid (\d+)\) loaded")


def engine_process_server(checkpoint, log_path, *flags: str) -> ServerProcess:
    """`mili serve --engine-process`, not started yet (a context manager: started, then stopped)."""
    return mili_serve_process("mili-engine-process", checkpoint, log_path, *SERVE_FLAGS, *flags)


def engine_pid(server: ServerProcess) -> int:
    [pid] = READY_LINE.findall(server.log_tail())
    return int(pid)


@pytest.fixture(scope="module")
def ep_server(tiny_checkpoint, tmp_path_factory) -> Iterator[ServerProcess]:
    with engine_process_server(tiny_checkpoint, tmp_path_factory.mktemp("ep-server") / "server.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        assert engine_pid(server) != server.process.pid
        yield server


@pytest.fixture(scope="module")
def api_base(ep_server) -> str:  # conftest's `client` is the SDK on it
    return ep_server.spec.base_url + "/v1"


def test_greedy_completions_match_the_in_process_engine(client, tiny_checkpoint):
    check_greedy_completions_match_offline(client, MODEL, tiny_checkpoint, n=2)


def test_greedy_chat_matches_the_in_process_server(client, real_server):
    in_process = sdk_client(real_server.api_base)
    for messages in (HELLO, [{"role": "user", "content": "Count to five, slowly."}]):
        want = in_process.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
        got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].message.model_extra == want.choices[0].message.model_extra
        assert got.usage == want.usage
        streamed = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10,
                                                  stream=True)
        content = "".join(c.delta.content or "" for chunk in streamed for c in chunk.choices)
        assert content == (want.choices[0].message.content or "")


def test_bad_requests_are_400s_and_the_server_keeps_serving(ep_server, client):
    url = ep_server.spec.base_url + "/v1/completions"
    too_long = [1] * (REAL_ENGINE_CONFIG["max_model_len"] + 10)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}
    bad_bodies = [{"prompt": too_long, "max_tokens": 4}, {"prompt": "Hi", "max_tokens": 4, "guided_regex": "[ab"},
                  {"prompt": "Hi", "max_tokens": 4, "response_format": bad_schema}]
    for body in bad_bodies:
        response = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, response_format=bad_schema)
    after = client.completions.create(model=MODEL, prompt="Still there?", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 3


def test_a_client_that_goes_away_frees_its_pages(ep_server):
    base = ep_server.spec.base_url
    body = {"model": MODEL, "prompt": "keep going " * 20, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        engine = httpx.get(base + "/debug/engine", timeout=60).json()
        assert engine["pages"]["num_sequences"] == 1 and engine["pages"]["num_owned"] > 0
    # the connection is closed: the server aborts the request, the engine process frees its pages

    def pages() -> dict:
        return httpx.get(base + "/debug/engine", timeout=60).json()["pages"]

    assert wait_until(lambda: pages()["num_sequences"] == 0, PAGES_FREED_TIMEOUT_S)
    pages = pages()
    assert pages["num_owned"] == 0 and pages["num_locked"] == 0 and pages["integrity_error"] is None
    assert pages["num_free"] + pages["num_cached"] == pages["num_pages"]


def test_metrics_count_what_the_engine_process_finished(ep_server, client):
    def finished_total() -> float:
        text = httpx.get(ep_server.spec.base_url + "/metrics", timeout=60).text
        return sum(float(value) for value in re.findall(r'^mili_requests_finished_total\{[^}]*\} (\S+)$', text, re.M))

    before = finished_total()
    client.completions.create(model=MODEL, prompt="Count me", max_tokens=3, n=2, temperature=0)
    assert finished_total() == before + 2  # one per sample, counted before the response ends
    text = httpx.get(ep_server.spec.base_url + "/metrics", timeout=60).text
    assert re.search(r"^mili_e2e_request_latency_seconds_count [1-9]", text, re.M)
    assert re.search(r"^mili_generation_tokens_total [1-9]", text, re.M)


def test_sigterm_to_the_process_group_drains_then_exits_0(tiny_checkpoint, tmp_path):
    """Only the server handles the signal: the engine process, signalled too, keeps serving the drain."""
    with engine_process_server(tiny_checkpoint, tmp_path / "server.log", "--shutdown-grace-period", "60") as server:
        server.wait_healthy(START_TIMEOUT_S)
        payloads = interrupted_stream(server.spec.base_url, MODEL,
                                      lambda: os.killpg(server.process.pid, signal.SIGTERM), 40, prompt="in flight")
        code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    assert code == 0, server.log_tail()
    assert payloads[-1] == "[DONE]"
    events = [orjson.loads(event) for event in payloads[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(event["choices"][0]["text"]) > 0 for event in events) > 1


def test_a_killed_engine_process_stops_the_server(tiny_checkpoint, tmp_path):
    with engine_process_server(tiny_checkpoint, tmp_path / "server.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        pid = engine_pid(server)
        payloads = interrupted_stream(server.spec.base_url, MODEL, lambda: os.kill(pid, signal.SIGKILL), 400)
        code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    assert code != 0
    log = server.log_tail()
    assert f"the engine process (pid {pid}) was killed by signal 9 (SIGKILL)" in log
    assert "exiting: the engine cannot continue" in log
    errors = stream_error_messages(payloads)
    assert errors and "the engine process" in errors[0]


# ---- the flag ----
@pytest.mark.parametrize(("argv", "chosen", "cpu", "cuda"), [([], None, False, True),
                                                              (["--engine-process"], True, True, True),
                                                              (["--no-engine-process"], False, False, False)])
def test_the_flag_picks_the_process_and_the_device_picks_the_default(argv, chosen, cpu, cuda):
    config = cli.config_from_args(cli.build_parser().parse_args(["serve", *argv])).engine
    assert config.engine_process is chosen
    assert config.for_device("cpu").engine_process is cpu and config.for_device("cuda").engine_process is cuda


# ---- the frame codec ----
def test_frames_cross_a_socket_pair_in_order_both_ways():
    async def exchange() -> tuple[list, list]:
        left, right = socket.socketpair()
        left_reader, left_writer = await asyncio.open_connection(sock=left)
        right_reader, right_writer = await asyncio.open_connection(sock=right)
        delta = SequenceDelta("r", "héllo", [1, 2], None, None, None, 3, 0, 2, index=1)
        submit = Submit(EngineRequest([1, 2, 3], SamplingParams(n=2, max_tokens=5), 5), "r")
        sent = [submit, Outputs([delta] * 300), "x" * 200_000]
        for message in sent:
            write_frame(left_writer, message)
        write_frame(right_writer, Outputs(sequences_received=7))
        received = [await read_frame(right_reader) for _ in sent]
        back = [await read_frame(left_reader)]
        left_writer.close()
        with pytest.raises(asyncio.IncompleteReadError):  # the other side closed: the reader's end
            await read_frame(right_reader)
        right_writer.close()
        return received, back

    received, back = asyncio.run(exchange())
    assert received[0] == Submit(EngineRequest([1, 2, 3], SamplingParams(n=2, max_tokens=5), 5), "r")
    assert received[1].deltas == [SequenceDelta("r", "héllo", [1, 2], None, None, None, 3, 0, 2, index=1)] * 300
    assert received[2] == "x" * 200_000
    assert back[0].sequences_received == 7


def test_a_blocking_reader_reads_whole_frames_and_sees_the_end():
    left, right = socket.socketpair()
    with left, right:
        payload = encode_frame({"a": list(range(1000))})
        assert FRAME_HEADER.unpack(payload[:FRAME_HEADER.size]) == (len(payload) - FRAME_HEADER.size,)

        def dribble() -> None:  # a frame that arrives over many reads, then the start of one, then the end
            for i in range(0, len(payload), 7):
                left.sendall(payload[i:i + 7])
            left.sendall(payload[:3])
            left.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=dribble)
        sender.start()
        assert recv_frame(right) == {"a": list(range(1000))}
        with pytest.raises(EOFError):
            recv_frame(right)
        sender.join()


# ---- the engine process's side of a request with a format ----
class CompilingEngine:
    """What `EngineServer` calls of an `AsyncEngine`, with a format compile that runs until released."""

    fatal_error = None

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.queued: list[str] = []
        self.aborted: list[str] = []

    def set_observer(self, observer) -> None:
        pass

    def stats(self):
        return None

    async def compile_format(self, params) -> None:
        await self.release.wait()

    def submit_to(self, sink, request, request_id: str) -> None:
        self.queued.append(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_an_abort_while_the_format_compiles_means_the_request_is_never_queued():
    from mili_openai.engine.engine_process import EngineServer
    from mili_openai.engine.process_messages import Abort, Reply

    async def go():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        engine = CompilingEngine()
        server = EngineServer(engine, reader, writer)
        request = EngineRequest([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), 5)
        server._handle(Submit(request, "dropped", call_id=1))
        server._handle(Submit(request, "kept", call_id=2))
        await asyncio.sleep(0)  # both compiles are running
        server._handle(Abort("dropped"))  # the server gave up on it: its compile is cancelled
        engine.release.set()
        message = await read_frame(their_reader)
        while not isinstance(message, Reply):  # the outbox's stats updates come first
            message = await read_frame(their_reader)
        writer.close()
        their_writer.close()
        return engine, message

    engine, reply = asyncio.run(go())
    assert engine.queued == ["kept"] and engine.aborted == []
    assert (reply.call_id, reply.error) == (2, None)
