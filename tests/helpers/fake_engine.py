"""A fake engine following the server's `EngineClient` Protocol, for route tests: scripted tokens, no
model, instant.

`FakeEngine(tokenizer)` generates from the words of `FAKE_WORDS` (as the real tokenizer encodes them)
into the engine's own `RequestStream`s, fanning a request of n samples out as the engine does (one task
per sample, seeded by `child_params`), reports cached tokens for prompts sharing page-aligned prefixes
with earlier ones, and can fail every request (`fail_with`) or pace its tokens (`token_delay_s`).
tests/conftest.py builds it as the `fake_engine` fixture. `ScriptedEngine` streams a fixed text instead, for
route tests of outputs a random-weight model would never write.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from mili_openai.config import EngineConfig
from mili_openai.engine.client import RequestStream
from mili_openai.engine.contract import EngineInfo, EngineRequest
from mili_openai.engine.outputs import (
    EngineObserver,
    EngineStats,
    PageAccounting,
    SequenceDelta,
    TokenLogprob,
    abort_deltas,
)
from mili_openai.engine.parallel_sampling import ParentRequest, child_params
from mili_openai.engine.sampling_params import SamplingParams

FAKE_VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer knows 151669 of them)
FAKE_WORDS = " the quick brown fox jumps over a lazy dog and then sleeps in warm sun"

# two Hermes tool calls after some text, as a scripted Qwen3 writes them (chat and LangChain tests)
TOOL_CALL_TEXT = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


class FakeEngine:
    """Scripted generation: greedy output cycles through FAKE_WORDS from a prompt-dependent start;
    a seed picks words at random reproducibly. Tracks "pages" so tests can see aborts free them, and
    reports cached tokens for prompts that share page-aligned prefixes with earlier ones."""

    def __init__(self, tokenizer, max_model_len: int = 256, num_pages: int = 64, page_size: int = 16,
                 token_delay_s: float = 0.0, fail_with: str | None = None) -> None:
        self.config = EngineConfig(page_size=page_size, num_pages=num_pages, max_model_len=max_model_len)
        # a test may replace it, e.g. to give the model sampling defaults
        self.info = EngineInfo(tokenizer=tokenizer, model_path=Path("/fake/Qwen3-fake"), max_model_len=max_model_len,
                               vocab_size=FAKE_VOCAB_SIZE, eos_token_ids=(tokenizer.eos_token_id,), quantization=None,
                               sampling_defaults={})
        self.tokenizer = tokenizer
        self.token_delay_s = token_delay_s
        self.fail_with = fail_with  # set: every request ends with this engine error
        self.fatal_error: str | None = None  # as AsyncEngine's: set, the server exits non-zero
        self.words = tokenizer.encode(FAKE_WORDS)
        self.num_pages, self.page_size = num_pages, page_size
        self.owned: dict[str, int] = {}  # sequence id -> pages held
        self.tasks: dict[str, asyncio.Task] = {}  # sequence id -> its generation
        self.requests: dict[str, ParentRequest] = {}
        self.streams_of: dict[str, RequestStream] = {}  # sequence id -> its request's stream
        self.seen_prompts: list[list[int]] = []
        self.submitted: list[tuple[list[int], SamplingParams, str]] = []
        self.started = False
        self.generated_total = 0

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.abort_all()
        self.started = False

    def abort_all(self) -> int:
        request_ids = list(self.requests)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    async def close(self) -> None:
        """The fake holds nothing beyond its tasks, which `shutdown` ended."""

    async def page_accounting(self) -> PageAccounting:
        used = sum(self.owned.values())
        return PageAccounting(self.num_pages, self.num_pages - used, 0, 0, used, len(self.tasks), None)

    def set_observer(self, observer: EngineObserver | None) -> None:
        """The fake reports no per-request metrics."""

    def is_ready(self) -> bool:
        return self.started

    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        return self.info.lora_adapters  # none loaded or unloaded at run time: the routes of those need a real engine

    def stats(self) -> EngineStats:
        used = sum(self.owned.values())
        return EngineStats(len(self.tasks), 0, self.num_pages, self.num_pages - used, 0, used / self.num_pages,
                           0, 0, 0, 0, self.generated_total)

    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return min(best, len(prompt) - 1) // self.page_size * self.page_size

    async def submit(self, request: EngineRequest, request_id: str | None = None) -> RequestStream:
        """A request the route checked (engine/contract.py); the fake has no grammar to compile: it writes its
        canned tokens whatever the format."""
        if not self.started:
            raise RuntimeError("the engine is not started")
        request_id = request_id or f"fake-{len(self.submitted)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, params = list(request.prompt_token_ids), request.params
        self.submitted.append((prompt, params, request_id))
        parent = ParentRequest.of(request_id, params)
        self.requests[request_id] = parent
        stream = RequestStream(request_id, parent.num_samples, self.abort)
        room = self.info.max_model_len - len(prompt)
        for index, sequence_id in enumerate(parent.child_ids):
            self.owned[sequence_id] = -(-len(prompt) // self.page_size)
            self.streams_of[sequence_id] = stream
            self.tasks[sequence_id] = asyncio.create_task(self._generate(
                stream, sequence_id, index, prompt, child_params(params, index), room))
        return stream

    def abort(self, request_id: str) -> None:
        parent = self.requests.pop(request_id, None)
        if parent is None:
            return
        running = [index for index, sequence_id in enumerate(parent.child_ids) if sequence_id in self.tasks]
        for delta in abort_deltas(request_id, running):
            sequence_id = parent.child_ids[delta.index]
            self.tasks.pop(sequence_id).cancel()
            self.owned.pop(sequence_id, None)
            self.streams_of.pop(sequence_id).put(delta)

    def _next_token(self, rng: random.Random | None, start: int, step: int) -> int:
        if rng is not None:
            return rng.choice(self.words)
        return self.words[(start + step) % len(self.words)]

    async def _generate(self, stream: RequestStream, sequence_id: str, index: int, prompt: list[int],
                        params: SamplingParams, room: int) -> None:
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        cached = self._cached_tokens(prompt)
        rng = None if params.temperature == 0 else random.Random(params.seed)
        start = sum(prompt)
        text, emitted, tokens = "", 0, []
        for step in range(max_tokens):
            await asyncio.sleep(self.token_delay_s)
            if self.fail_with is not None:
                finish, stop_reason, new_text, token = "abort", None, "", []
            else:
                token_id = self._next_token(rng, start, step)
                tokens.append(token_id)
                text = self.tokenizer.decode(tokens)
                finish, stop_reason = None, None
                for stop in params.stop:
                    if stop in text:
                        text, finish, stop_reason = text[: text.index(stop)], "stop", stop
                        break
                if finish is None and step == max_tokens - 1:
                    finish = "length"
                new_text, emitted, token = text[emitted:], len(text), [token_id]
            self.generated_total += len(token)
            self.owned[sequence_id] = -(-(len(prompt) + len(tokens)) // self.page_size)
            logprobs = None
            if params.logprobs is not None and token:
                top = [(w, -0.5 - i) for i, w in enumerate(self.words[: params.logprobs])]
                logprobs = [TokenLogprob(token[0], -0.25, top)]
            request_finished = finish is not None and self._finished(stream.request_id, sequence_id, index)
            if finish is not None:
                self.seen_prompts.append(prompt)
            stream.put(SequenceDelta(stream.request_id, new_text, token, logprobs, finish,
                                     stop_reason if finish == "stop" else None, len(prompt), cached, len(tokens),
                                     error=self.fail_with, index=index, request_finished=request_finished))
            if finish is not None:
                return

    def _finished(self, request_id: str, sequence_id: str, index: int) -> bool:
        """Sample `index` finished; returns whether it was the request's last."""
        self.tasks.pop(sequence_id, None)
        self.owned.pop(sequence_id, None)
        self.streams_of.pop(sequence_id, None)
        parent = self.requests.get(request_id)
        if parent is None or not parent.progress.finish(index):
            return False
        del self.requests[request_id]
        return True


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose every sample streams `script`, one token per delta, then
    finishes with "stop" (or "length" at max_tokens)."""

    def __init__(self, tokenizer, script: str = "", **kwargs) -> None:
        super().__init__(tokenizer, **kwargs)
        self.script = script

    async def _generate(self, stream, sequence_id, index, prompt, params, room) -> None:
        tokens = self.tokenizer.encode(self.script, add_special_tokens=False)
        limit = min(params.max_tokens or room, room)
        emitted = ""
        for step, token in enumerate(tokens[:limit]):
            await asyncio.sleep(0)
            text = self.tokenizer.decode(tokens[: step + 1])
            last = step == len(tokens[:limit]) - 1
            finish = None if not last else ("stop" if len(tokens) <= limit else "length")
            logprobs = None
            if params.logprobs is not None:
                logprobs = [TokenLogprob(token, -0.5, [(token, -0.5), (self.words[0], -1.5)][: params.logprobs])]
            request_finished = finish is not None and self._finished(stream.request_id, sequence_id, index)
            stream.put(SequenceDelta(stream.request_id, text[len(emitted):], [token], logprobs, finish, None,
                                     len(prompt), 0, step + 1, index=index, request_finished=request_finished))
            emitted = text
