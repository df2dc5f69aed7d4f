"""POST /v1/chat/completions: chat template in, reasoning / content / tool calls out.

Every choice is submitted before the response starts, so a bad request is a plain 400 and never a
broken stream. A stream sends, per choice, a first chunk with `role: "assistant"`, then the
content, reasoning and tool-call deltas, and exactly one chunk with its `finish_reason`; then a
usage chunk when `stream_options.include_usage` asks for it, then `[DONE]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.engine.image_processor import expand_image_placeholders
from mili_openai.engine.outputs import CompletionOutput, SequenceDelta
from mili_openai.engine.sampling_params import SamplingParams, StructuredOutputsParams
from mili_openai.protocol.chat import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChunkChoice,
    DeltaMessage,
    FunctionOut,
    ResponseMessage,
    ToolCallDeltaOut,
    ToolCallOut,
    UsageOut,
    text_chunk_event,
)
from mili_openai.protocol.chat_output import ChatDelta, ChatOutputParser, OutputOptions, parse_whole_output
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.image_loading import load_images, request_image_urls
from mili_openai.protocol.logprobs import TokenPieces, chat_logprobs_object, prompt_logprobs_object
from mili_openai.protocol.prompts import RenderedPrompt, render_chat_prompt
from mili_openai.protocol.reasoning import THINK_END, output_reasoning_mode
from mili_openai.protocol.tool_call_parsers import model_tool_parser, tool_call_grammar
from mili_openai.routes.job import GenerationJob, serve_job
from mili_openai.server.state import ServerState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALLS_FINISH = "tool_calls"
ABORT_FINISH = "abort"
LENGTH_FINISH = "length"
PROMPT_FIELD = "messages"  # what a chat request's prompt is, in its errors


def has_think_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Qwen3 vocabularies have `</think>` as one token; other models get no reasoning split."""
    token_id = tokenizer.convert_tokens_to_ids(THINK_END)
    return token_id is not None and token_id != tokenizer.unk_token_id


def finish_reason_of(engine_reason: str | None, num_calls: int) -> str | None:
    """Like vLLM: a choice that produced tool calls finishes with "tool_calls", unless aborted or cut by
    max_tokens ("length" says the output, calls included, may be cut)."""
    if engine_reason not in (None, ABORT_FINISH, LENGTH_FINISH) and num_calls:
        return TOOL_CALLS_FINISH
    return engine_reason


class ChatJob(GenerationJob[ChatCompletionRequest]):
    """One validated chat request bound to the engine: prompt, parameters, submitted streams."""

    id_prefix = "chatcmpl"

    def __init__(self, server: ServerState, body: ChatCompletionRequest, request_id: str) -> None:
        super().__init__(server, body, request_id)
        self.prompt: RenderedPrompt | None = None
        self.top_k = (body.top_logprobs or 0) if body.logprobs else None
        self.pieces = TokenPieces(self.engine.info.tokenizer)
        choice = body.effective_tool_choice
        self.options = OutputOptions(
            split_reasoning=has_think_tags(self.engine.info.tokenizer),
            include_reasoning=body.include_reasoning,
            parse_tools=bool(body.tools) and choice != "none",
            max_calls=None if body.parallel_tool_calls else 1,
            tool_parser=model_tool_parser(server.config.tool_call_parser, self.engine.info.tokenizer),
            tools=body.tools,
        )

    def sampling_params(self) -> SamplingParams:
        return self.body.to_sampling_params(self.engine.info.vocab_size, self.engine.info.sampling_defaults,
                                            logprobs=self.top_k, max_tokens=self.body.output_limit,
                                            prompt_logprobs=self.body.prompt_logprobs)

    async def submit(self) -> None:
        params = self.sampling_params()
        images = await load_images(request_image_urls(self.body), self.server.config.media,
                                   self.server.image_preprocessor())
        self.prompt = await render_chat_prompt(self.engine.info.tokenizer, self.body)
        choice = self.body.effective_tool_choice
        if self.options.parse_tools and choice != "auto":  # "required" or a named function: enforced
            # the output is then tool calls and no text, so an output format (which shapes text) has nothing
            # to apply to: the calls' grammar replaces it (agents send both, a format for the final answer)
            parallel = self.body.parallel_tool_calls and choice == "required"  # a named function: one call
            grammar = tool_call_grammar(self.options.tool_parser, self.engine.info.tokenizer, self.body.tools, choice,
                                        parallel)
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))
        if params.structured_outputs is not None and self.options.split_reasoning:
            # the format starts after the model's thinking, as vLLM's with a reasoning parser
            mode = output_reasoning_mode(self.prompt.assistant_tail)
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, reasoning=mode))
        token_ids = self.prompt.token_ids
        if images:  # each image's one placeholder, as the template wrote it, becomes one per merged patch
            try:
                token_ids = expand_image_placeholders(token_ids, images, self.engine.info.vision.image_token_id)
            except ValueError as exc:
                raise APIError(400, str(exc), param=PROMPT_FIELD) from None
        await self.submit_prompts([token_ids], params, prompt_field=PROMPT_FIELD, images=images or None)

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.prompt.assistant_tail, self.options)

    def logprobs_of(self, delta_logprobs: list | None) -> dict[str, Any] | None:
        """The logprobs object of some tokens, as sent (the models take it as it is)."""
        if self.top_k is None:
            return None
        return chat_logprobs_object(self.pieces, delta_logprobs or [], self.top_k)

    def usage_out(self) -> UsageOut:
        return UsageOut.model_validate(self.usage().to_dict())

    # ---- whole response ----
    def choice(self, output: CompletionOutput) -> Choice:
        parsed = parse_whole_output(output.text, self.prompt.assistant_tail, self.options)
        calls = [ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments)) for c in parsed.calls]
        reasoning = parsed.reasoning or None
        content = parsed.content if parsed.content or not calls else None
        message = ResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls)
        return Choice(index=output.index, message=message, logprobs=self.logprobs_of(output.logprobs),
                      finish_reason=finish_reason_of(output.finish_reason, len(calls)),
                      stop_reason=output.stop_reason)

    async def collect(self) -> dict[str, Any]:
        [result] = await self.outputs()
        response = ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                          choices=[self.choice(o) for o in result.outputs],
                                          usage=self.usage_out()).model_dump()
        if self.body.prompt_logprobs is not None:  # vLLM's extra, only when the request asked for it
            response["prompt_logprobs"] = prompt_logprobs_object(self.engine.info.tokenizer, result.prompt_logprobs,
                                                                 self.body.prompt_logprobs)
        return response

    # ---- stream ----
    def chunk(self, choices: list[ChunkChoice], usage: UsageOut | None = None) -> dict[str, Any]:
        event = ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                    choices=choices, usage=usage).to_event()
        if usage is None and not self.include_usage:
            del event["usage"]
        return event

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    def delta_chunk(self, index: int, parsed: ChatDelta, delta: SequenceDelta, finish_reason: str | None) -> dict[str, Any]:
        """One choice's chunk: one without tool calls (most of a stream) as a plain dict, the rest through the
        models."""
        if parsed.calls:
            return self.chunk([self.delta_choice(index, parsed, delta, finish_reason)])
        # the tokens' logprobs go with the chunk they arrived in, even when a parser holds their text
        logprobs = self.logprobs_of(delta.logprobs) if delta.logprobs or finish_reason else None
        return text_chunk_event(self.response_id, self.created, self.model, index, parsed.content or None,
                                parsed.reasoning or None, finish_reason, delta.stop_reason if finish_reason else None,
                                self.include_usage, logprobs)

    def delta_choice(self, index: int, parsed: ChatDelta, delta: SequenceDelta,
                     finish_reason: str | None) -> ChunkChoice:
        reasoning = parsed.reasoning or None
        message = DeltaMessage(content=parsed.content or None, reasoning_content=reasoning, reasoning=reasoning)
        if parsed.calls:
            # as vLLM's: a call's first entry has its id, type and name, the later ones pieces of its arguments
            message.tool_calls = [
                ToolCallDeltaOut(index=piece.index, id=piece.id, type="function" if piece.id else None,
                                 function=FunctionOut(name=piece.name, arguments=piece.arguments))
                for piece in parsed.calls
            ]
        # the tokens' logprobs go with the chunk they arrived in, even when a parser holds their text
        logprobs = self.logprobs_of(delta.logprobs) if delta.logprobs or finish_reason else None
        return ChunkChoice(index=index, delta=message, logprobs=logprobs, finish_reason=finish_reason,
                           stop_reason=delta.stop_reason if finish_reason else None)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        parsers = [self.parser() for _ in range(self.num_samples)]
        for index in range(self.num_samples):
            role = DeltaMessage(role="assistant", content="")
            yield self.chunk([ChunkChoice(index=index, delta=role, logprobs=None, finish_reason=None)])
        async with aclosing(self.deltas()) as deltas:
            async for index, delta in deltas:
                parser = parsers[index]
                parsed = parser.feed(delta.text)
                finish_reason = None
                if delta.finish_reason is not None:
                    parsed.extend(parser.finish())
                    finish_reason = finish_reason_of(delta.finish_reason, parser.num_calls)
                if not parsed and finish_reason is None and not (self.top_k is not None and delta.logprobs):
                    continue  # nothing to show yet (text held back by a parser or the detokenizer)
                yield self.delta_chunk(index, parsed, delta, finish_reason)
        if self.include_usage:
            yield self.chunk([], self.usage_out())


async def create_chat_completion(request: Request) -> Response:
    return await serve_job(request, ChatCompletionRequest, ChatJob)


def routes() -> list[Route]:
    return [Route("/v1/chat/completions", create_chat_completion, methods=["POST"])]
