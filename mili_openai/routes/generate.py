"""The seed API: POST /generate (one sequence, plain shapes) and GET /status/{request_id}.

/generate {"prompt": text or token ids, "max_tokens", sampling fields..., "stream"} answers
{"request_id", "text", "token_ids", "finish_reason", "stop_reason", "usage"}; with "stream": true
it sends one event per engine delta ({"request_id", "text", "token_ids", "finish_reason"}), then
one {"request_id", "usage"} event, then [DONE]. The request id is the X-Request-Id header when
given, so a client can poll /status while its request runs; /status reports the state (waiting
until the first token, running, finished or aborted), the tokens so far and timings. Finished
requests are remembered in a bounded LRU; an unknown id is a 404.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.outputs import SequenceDelta, TokenLogprob
from mili_openai.engine.sampling_params import MAX_LOGPROBS
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.prompts import prompt_token_ids
from mili_openai.protocol.sampling import SamplingFields
from mili_openai.routes.job import GenerationJob, serve_job
from mili_openai.server.errors import json_response
from mili_openai.server.state import RequestRecord, ServerState, server_state


class GenerateRequest(SamplingFields):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _one_sequence(self) -> GenerateRequest:
        if self.n != 1:
            raise ValueError("/generate runs one sequence: n must be 1 (use /v1/completions for more)")
        return self


def logprobs_json(delta_logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    if delta_logprobs is None:
        return None
    return [{"token_id": e.token_id, "logprob": e.logprob, "top": [[t, lp] for t, lp in e.top]}
            for e in delta_logprobs]


class GenerateJob(GenerationJob[GenerateRequest]):
    """A /generate request: the engine request and its /status record share the request's own id."""

    def __init__(self, server: ServerState, body: GenerateRequest, request_id: str) -> None:
        super().__init__(server, body, request_id)
        self.request_id = self.response_id = request_id
        self.record: RequestRecord | None = None

    async def submit(self) -> None:
        params = self.body.to_sampling_params(self.engine.info.vocab_size, self.engine.info.sampling_defaults,
                                              logprobs=self.body.logprobs)
        prompts = await prompt_token_ids(self.engine.info.tokenizer, [self.body.prompt], self.engine.info.vocab_size)
        self.record = self.server.records.start(self.request_id, len(prompts[0]))
        try:
            await self.submit_prompts(prompts, params)
        except BaseException:
            self.server.records.close(self.record)
            raise

    def abort(self) -> None:
        """Abort what still runs and file the record (also when its stream was never consumed)."""
        super().abort()
        if self.record is not None:
            self.server.records.close(self.record)

    async def recorded_deltas(self) -> AsyncIterator[SequenceDelta]:
        try:
            async with aclosing(self.deltas()) as deltas:
                async for _, delta in deltas:
                    self.record.observe(delta)
                    yield delta
        finally:
            self.server.records.close(self.record)

    async def collect(self) -> dict[str, Any]:
        async with aclosing(self.recorded_deltas()) as deltas:
            async for _ in deltas:
                pass
        output = self.record.output
        return {
            "request_id": self.request_id,
            "text": output.text,
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
            "logprobs": logprobs_json(output.logprobs or []) if self.body.logprobs is not None else None,
            "usage": self.usage().to_dict(),
        }

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        async with aclosing(self.recorded_deltas()) as deltas:
            async for delta in deltas:
                yield {
                    "request_id": self.request_id,
                    "text": delta.text,
                    "token_ids": delta.token_ids,
                    "logprobs": logprobs_json(delta.logprobs),
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
        yield {"request_id": self.request_id, "usage": self.usage().to_dict()}


async def generate(request: Request) -> Response:
    return await serve_job(request, GenerateRequest, GenerateJob)


async def status(request: Request) -> Response:
    server = server_state(request)
    request_id = request.path_params["request_id"]
    record = server.records.get(request_id)
    if record is None:
        raise APIError(404, f"no request with id {request_id!r} is known (finished ones are kept for a while)",
                       param="request_id", code="request_not_found")
    return json_response(record.to_dict())


def routes() -> list[Route]:
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/status/{request_id}", status, methods=["GET"]),
    ]
