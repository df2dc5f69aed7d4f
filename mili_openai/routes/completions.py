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

from mili_openai.engine.outputs import CompletionOutput, SequenceDelta, TokenLogprob
from mili_openai.protocol.completions import CompletionRequest, choice_object, completion_object
from mili_openai.protocol.logprobs import CompletionLogprobs, TokenPieces, merge_logprobs, prompt_logprobs_object
from mili_openai.protocol.prompts import prompt_text, prompt_token_ids
from mili_openai.routes.job import GenerationJob, Usage, serve_job
from mili_openai.server.state import ServerState


def without_generation(part: CompletionOutput | SequenceDelta) -> CompletionOutput | SequenceDelta:
    """A choice of an echo-only request (a finished output, or a streamed delta) as shown: nothing
    generated, and it ends as "length" (its budget of 0 tokens is spent) unless it was aborted."""
    finish = part.finish_reason if part.finish_reason in (None, "abort") else "length"
    return dataclasses.replace(part, text="", token_ids=[], logprobs=None, finish_reason=finish, stop_reason=None)


class CompletionJob(GenerationJob[CompletionRequest]):
    """One validated request bound to the engine: its prompts, parameters and submitted streams."""

    id_prefix = "cmpl"

    def __init__(self, server: ServerState, body: CompletionRequest, request_id: str) -> None:
        super().__init__(server, body, request_id)
        self.n = body.n
        self.prompts = body.prompts()
        self.pieces = TokenPieces(self.engine.info.tokenizer)  # shared by every choice's logprobs

    @property
    def num_sequences(self) -> int:
        return self.n * len(self.prompts)  # every sample of every prompt is a sequence

    async def submit(self) -> None:
        info = self.engine.info
        # echo with logprobs scores the prompt too, as OpenAI's legacy API and vLLM do
        prompt_logprobs = self.body.scored_prompt_top_k
        # echo-only requests generate one token, never shown: the engine always samples after a prompt
        limit = {"max_tokens": 1} if self.body.echo_only else {}
        params = self.body.to_sampling_params(info.vocab_size, info.sampling_defaults, logprobs=self.body.logprobs,
                                              prompt_logprobs=prompt_logprobs, **limit)
        prompts = await prompt_token_ids(info.tokenizer, self.prompts, info.vocab_size)
        await self.submit_prompts(prompts, params)

    def usage(self) -> Usage:
        usage = super().usage()
        return dataclasses.replace(usage, completion_tokens=0) if self.body.echo_only else usage

    def prompt_of(self, choice: int) -> int:
        return choice // self.n

    def logprobs_builder(self) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        return CompletionLogprobs(self.pieces, self.body.logprobs)

    def token_ids(self, choice: int, generated: list[int], first: bool) -> tuple[list[int] | None, list[int]] | None:
        """`return_token_ids`' fields of a choice: its prompt's ids (on the first chunk only) and `generated`."""
        if not self.body.return_token_ids:
            return None
        return (list(self.prompt_ids[self.prompt_of(choice)]) if first else None), list(generated)

    def echo_prefix(self, choice: int, builder: CompletionLogprobs | None,
                    scored: list[TokenLogprob | None] | None) -> tuple[str, dict | None]:
        """The echoed prompt text of a choice, and its tokens with the engine's scores (`scored`, one entry
        per prompt token) when logprobs are on."""
        if not self.body.echo:
            return "", None
        prompt = self.prompts[self.prompt_of(choice)]
        text = prompt_text(self.engine.info.tokenizer, prompt)
        logprobs = builder.prompt(self.prompt_ids[self.prompt_of(choice)], scored) if builder is not None else None
        return text, logprobs

    # ---- whole response ----
    def choice(self, choice: int, output: CompletionOutput,
               scored: list[TokenLogprob | None] | None) -> dict[str, Any]:
        builder = self.logprobs_builder()
        text, logprobs = self.echo_prefix(choice, builder, scored)
        if builder is not None:
            generated = builder.generated(output.logprobs or [])
            logprobs = merge_logprobs(logprobs, generated) if logprobs is not None else generated
        prompt_logprobs = None
        if self.body.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_object(self.engine.info.tokenizer, scored, self.body.prompt_logprobs)
        return choice_object(choice, text + output.text, logprobs, output.finish_reason, output.stop_reason,
                             prompt_logprobs, self.token_ids(choice, output.token_ids, first=True))

    async def collect(self) -> dict[str, Any]:
        choices = []
        for prompt, result in enumerate(await self.outputs()):
            for output in result.outputs:
                shown = without_generation(output) if self.body.echo_only else output
                choices.append(self.choice(prompt * self.n + output.index, shown, result.prompt_logprobs))
        return completion_object(self.response_id, self.created, self.model, choices, self.usage().to_dict())

    # ---- stream ----
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        include_usage, echo_only = self.body.include_usage, self.body.echo_only
        builders = [self.logprobs_builder() for _ in range(self.num_sequences)]
        started = [False] * self.num_sequences
        async with aclosing(self.deltas()) as deltas:  # closing us early must run the aborts now
            async for index, delta in deltas:
                if echo_only:
                    delta = without_generation(delta)
                text, logprobs, first = delta.text, None, not started[index]
                if first:
                    started[index] = True
                    echo_text, logprobs = self.echo_prefix(index, builders[index], delta.prompt_logprobs)
                    text = echo_text + text
                builder = builders[index]
                if builder is not None and delta.logprobs:
                    generated = builder.generated(delta.logprobs)
                    logprobs = merge_logprobs(logprobs, generated) if logprobs is not None else generated
                ids = self.token_ids(index, delta.token_ids, first)
                if not text and delta.finish_reason is None and logprobs is None and not (ids and ids[1]):
                    continue  # nothing to show yet (e.g. half a UTF-8 character held back)
                if builder is not None and logprobs is None:
                    logprobs = builder.generated([])
                choice = choice_object(index, text, logprobs, delta.finish_reason, delta.stop_reason, token_ids=ids)
                yield completion_object(self.response_id, self.created, self.model, [choice], None,
                                        include_usage_key=include_usage)
        if include_usage:
            yield completion_object(self.response_id, self.created, self.model, [], self.usage().to_dict())


async def create_completion(request: Request) -> Response:
    return await serve_job(request, CompletionRequest, CompletionJob)


def routes() -> list[Route]:
    return [Route("/v1/completions", create_completion, methods=["POST"])]
