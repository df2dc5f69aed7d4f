"""POST /v1/completions: text completion of one or several prompts, each with n choices.

Choice indices follow OpenAI: prompt p's sample i is choice `p * n + i`. Every prompt and sample is
submitted before the response starts, so a bad request is a plain 400 and never a broken stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.outputs import SequenceDelta, TokenLogprob
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.protocol.logprobs import CompletionLogprobs, merge_logprobs
from mili_openai.protocol.completions import CompletionRequest, choice_object, completion_object
from mili_openai.server.errors import cancel_on_disconnect, json_response, parse_body
from mili_openai.routes.job import (
    GenerationJob,
    ChoiceResult,
    abort_streams,
    collect_streams,
    merge_streams,
    raise_engine_error,
    submit_choices,
    usage_of,
)
from mili_openai.protocol.logprobs import prompt_logprobs_object
from mili_openai.protocol.prompts import prompt_text, prompt_token_ids
from mili_openai.server.sse import sse_stream
from mili_openai.server.state import ServerState, request_id_of, server_state


def submit_prompts(engine: Any, prompts: list[list[int]], params: SamplingParams, response_id: str) -> list:
    """Submit n sequences per prompt, in choice order; all or nothing."""
    streams: list = []
    try:
        for index, ids in enumerate(prompts):
            base = response_id if len(prompts) == 1 else f"{response_id}-{index}"
            streams.extend(submit_choices(engine, ids, params, base))
    except BaseException:
        abort_streams(engine, streams)
        raise
    return streams


def without_generation(part: ChoiceResult | SequenceDelta) -> ChoiceResult | SequenceDelta:
    """A choice of an echo-only request (a finished result, or a streamed delta) as shown: nothing
    generated, and it ends as "length" (its budget of 0 tokens is spent) unless it was aborted."""
    finish = part.finish_reason if part.finish_reason in (None, "abort") else "length"
    return dataclasses.replace(part, text="", token_ids=[], logprobs=None, finish_reason=finish, stop_reason=None)


class CompletionJob(GenerationJob):
    """One validated request bound to the engine: its prompts, parameters and submitted streams."""

    id_prefix = "cmpl"

    def __init__(self, server: ServerState, body: CompletionRequest, request_id: str) -> None:
        super().__init__(server, body, request_id)
        self.n = body.n
        self.prompts = body.prompts()
        self.prompt_ids: list[list[int]] = []

    async def submit(self) -> None:
        engine = self.engine
        # echo with logprobs scores the prompt too, as OpenAI's legacy API and vLLM do
        prompt_logprobs = self.body.scored_prompt_top_k
        # echo-only requests generate one token, never shown: the engine always samples after a prompt
        limit = {"max_tokens": 1} if self.body.echo_only else {}
        params = self.body.to_sampling_params(engine.vocab_size, engine.sampling_defaults, logprobs=self.body.logprobs,
                                              prompt_logprobs=prompt_logprobs, **limit)
        self.prompt_ids = await prompt_token_ids(engine.tokenizer, self.prompts, engine.vocab_size)
        await engine.compile_format(params)
        self.streams = submit_prompts(engine, self.prompt_ids, params, self.response_id)

    def prompt_of(self, choice: int) -> int:
        return choice // self.n

    def logprobs_builder(self) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        return CompletionLogprobs(self.engine.tokenizer, self.body.logprobs)

    def echo_prefix(self, choice: int, builder: CompletionLogprobs | None,
                    scored: list[TokenLogprob | None] | None) -> tuple[str, dict | None]:
        """The echoed prompt text of a choice, and its tokens with the engine's scores (`scored`, one entry
        per prompt token) when logprobs are on."""
        if not self.body.echo:
            return "", None
        prompt = self.prompts[self.prompt_of(choice)]
        text = prompt_text(self.engine.tokenizer, prompt)
        logprobs = builder.prompt(self.prompt_ids[self.prompt_of(choice)], scored) if builder is not None else None
        return text, logprobs

    def usage(self, cached_first_sample: list[int], completion_tokens: int) -> dict[str, Any]:
        return usage_of([len(ids) for ids in self.prompt_ids], cached_first_sample, completion_tokens).to_dict()

    # ---- whole response ----
    def choice(self, result: ChoiceResult) -> dict[str, Any]:
        builder = self.logprobs_builder()
        text, logprobs = self.echo_prefix(result.index, builder, result.prompt_logprobs)
        if builder is not None:
            generated = builder.generated(result.logprobs or [])
            logprobs = merge_logprobs(logprobs, generated) if logprobs is not None else generated
        prompt_logprobs = None
        if self.body.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_object(self.engine.tokenizer, result.prompt_logprobs,
                                                     self.body.prompt_logprobs)
        return choice_object(result.index, text + result.text, logprobs, result.finish_reason, result.stop_reason,
                             prompt_logprobs)

    async def collect(self) -> dict[str, Any]:
        results = await collect_streams(self.engine, self.streams, self.server.config.request_timeout_s)
        if self.body.echo_only:
            results = [without_generation(result) for result in results]
        cached = [results[p * self.n].num_cached_tokens for p in range(len(self.prompt_ids))]
        usage = self.usage(cached, sum(len(r.token_ids) for r in results))
        return completion_object(self.response_id, self.created, self.model, [self.choice(r) for r in results],
                                 usage)

    # ---- stream ----
    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        include_usage = self.body.include_usage
        builders = [self.logprobs_builder() for _ in self.streams]
        started = [False] * len(self.streams)
        cached = [0] * len(self.prompt_ids)
        completion_tokens = 0
        merged = merge_streams(self.engine, self.streams, self.server.config.request_timeout_s)
        async with aclosing(merged):  # closing us early must run merge_streams' aborts now
            async for index, delta in merged:
                raise_engine_error(delta)
                if self.body.echo_only:
                    delta = without_generation(delta)
                completion_tokens += len(delta.token_ids)
                if index % self.n == 0:
                    cached[self.prompt_of(index)] = delta.num_cached_tokens
                text, logprobs = delta.text, None
                if not started[index]:
                    started[index] = True
                    echo_text, logprobs = self.echo_prefix(index, builders[index], delta.prompt_logprobs)
                    text = echo_text + text
                builder = builders[index]
                if builder is not None and delta.logprobs:
                    generated = builder.generated(delta.logprobs)
                    logprobs = merge_logprobs(logprobs, generated) if logprobs is not None else generated
                if not text and delta.finish_reason is None and logprobs is None:
                    continue  # nothing to show yet (e.g. half a UTF-8 character held back)
                if builder is not None and logprobs is None:
                    logprobs = builder.generated([])
                choice = choice_object(index, text, logprobs, delta.finish_reason, delta.stop_reason)
                yield completion_object(self.response_id, self.created, self.model, [choice], None,
                                        include_usage_key=include_usage)
        if include_usage:
            yield completion_object(self.response_id, self.created, self.model, [],
                                    self.usage(cached, completion_tokens))


async def create_completion(request: Request) -> Response:
    server = server_state(request)
    body = await parse_body(request, CompletionRequest)
    server.check_model(body.model)
    server.require_engine()
    job = CompletionJob(server, body, request_id_of(request))
    server.check_queue(job.n * len(job.prompts))  # every sample of every prompt is a sequence
    await job.submit()
    if body.stream:
        return sse_stream(job.chunks(), job.abort, shutdown_grace_s=server.config.shutdown_grace_s)
    try:
        return json_response(await cancel_on_disconnect(request, job.collect()))
    finally:
        job.abort()  # no-op for finished sequences; frees everything if anything failed


def routes() -> list[Route]:
    return [Route("/v1/completions", create_completion, methods=["POST"])]
