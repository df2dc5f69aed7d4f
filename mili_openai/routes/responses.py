"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request becomes a chat request (protocol/responses.py) and runs as one: the chat template, the Qwen3
reasoning split, tool calls parsed back or enforced by a grammar, structured outputs, `serve_job`. Only
the output's shape differs: a list of items, a `reasoning` item for the thinking, a `message` for the
answer, a `function_call` per call.

A stream sends the typed events the openai SDK assembles, each with its `sequence_number` and an SSE
`event:` line: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
its content (`response.content_part.added`, `response.reasoning_text.delta` / `response.output_text.delta`
... `.done`, `response.content_part.done`; or `response.function_call_arguments.delta` ... `.done`, the
arguments in pieces as the model writes them) and `response.output_item.done`; last
`response.completed`, whose response says `incomplete` when max_output_tokens cut the output (as
vLLM does: the SDK's stream helpers wait for `response.completed`). Stored responses (`store`, the default)
live in the server's bounded, per-replica `ResponseStore`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mili_openai.protocol.chat_output import ChatDelta, parse_whole_output
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.responses import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    output_text_part,
    reasoning_item,
    response_object,
    usage_object,
)
from mili_openai.protocol.tool_calls import ParsedToolCall
from mili_openai.routes.chat import ABORT_FINISH, LENGTH_FINISH, ChatJob
from mili_openai.routes.job import serve_job
from mili_openai.server.errors import json_response
from mili_openai.server.state import ServerState, StoredResponse, server_state


class ResponsesJob(ChatJob):
    """A Responses request served as the chat request it maps to."""

    sse_event_names = True

    def __init__(self, server: ServerState, body: ResponsesRequest, request_id: str) -> None:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            try:
                history = server.responses.get(body.previous_response_id).items
            except APIError as exc:
                raise APIError(404, exc.message, param="previous_response_id", code=exc.code) from None
        try:
            chat = body.to_chat_request(history)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        super().__init__(server, chat, request_id)
        self.request = body
        self.response_id = new_item_id("resp")
        self.input_items = [*history, *body.input_items()]

    def reasoning_tokens(self, reasoning: str) -> int:
        """The thinking's tokens, counted on its text (the tags around it not included)."""
        return len(self.engine.info.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def response(self, output: list[dict[str, Any]], finish_reason: str | None, reasoning: str) -> dict[str, Any]:
        """The finished response (stored when the request asks to be)."""
        status = ("incomplete" if finish_reason == LENGTH_FINISH
                  else "cancelled" if finish_reason == ABORT_FINISH else "completed")
        usage = self.usage()
        response = response_object(self.response_id, self.created, self.model, self.request, status, output,
                                   usage_object(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                                                self.reasoning_tokens(reasoning)), finish_reason)
        if self.request.store:
            self.server.responses.put(StoredResponse(response, [*self.input_items, *output]))
        return response

    async def collect(self) -> dict[str, Any]:
        [result] = await self.outputs()
        output = result.outputs[0]
        parsed = parse_whole_output(output.text, self.prompt.assistant_tail, self.options)
        items = [reasoning_item(new_item_id("rs"), parsed.reasoning)] if parsed.reasoning else []
        if parsed.content or not parsed.calls:
            items.append(message_item(new_item_id("msg"), parsed.content))
        items.extend(function_call_item(new_item_id("fc"), call) for call in parsed.calls)
        return self.response(items, output.finish_reason, parsed.reasoning)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        stream = ResponseEvents()
        snapshot = response_object(self.response_id, self.created, self.model, self.request, "in_progress", [])
        yield stream.event("response.created", response=snapshot)
        yield stream.event("response.in_progress", response=snapshot)
        parser = self.parser()
        finish_reason = None
        async with aclosing(self.deltas()) as deltas:
            async for _, delta in deltas:
                parsed = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    parsed.extend(parser.finish())
                    finish_reason = delta.finish_reason
                for event in stream.feed(parsed):
                    yield event
        for event in stream.finish(parser.incomplete_calls):
            yield event
        yield stream.event("response.completed", response=self.response(stream.output, finish_reason, stream.reasoning))


class ResponseEvents:
    """The typed events of one streamed response: output items opened, filled and closed in order."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # the closed items, in order
        self.reasoning = ""  # all the thinking, for the usage's reasoning tokens
        self._kind: str | None = None  # the open item's type
        self._item_id = ""
        self._text = ""  # the open item's text or arguments
        self._call: ParsedToolCall | None = None  # the open function call (arguments so far)
        self._call_index = -1  # the parser's index of the open call

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    @property
    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": len(self.output)}

    def feed(self, parsed: ChatDelta) -> Iterator[dict[str, Any]]:
        if parsed.reasoning:
            self.reasoning += parsed.reasoning
            yield from self._text_delta("reasoning", parsed.reasoning)
        if parsed.content:
            yield from self._text_delta("message", parsed.content)
        for piece in parsed.calls:
            if piece.id is not None or piece.index != self._call_index:
                yield from self.close(set())
                yield from self._open("function_call", ParsedToolCall(piece.index, piece.id or "", piece.name or "", ""))
            self._text += piece.arguments
            if piece.arguments:
                yield self.event("response.function_call_arguments.delta", **self._where, delta=piece.arguments)

    def finish(self, incomplete_calls: set[int]) -> Iterator[dict[str, Any]]:
        """Close the open item; a stream with no item at all still ends with one (empty) message."""
        if self._kind is None and not self.output:
            yield from self._open("message")
        yield from self.close(incomplete_calls)

    def close(self, incomplete_calls: set[int]) -> Iterator[dict[str, Any]]:
        """Close the open item, if any (a function call the output cut off is `incomplete`)."""
        kind, text, where = self._kind, self._text, self._where
        if kind is None:
            return
        if kind == "function_call":
            status = "incomplete" if self._call_index in incomplete_calls else "completed"
            call = ParsedToolCall(self._call.index, self._call.id, self._call.name, text)
            yield self.event("response.function_call_arguments.done", **where, name=call.name, arguments=text)
            item = function_call_item(self._item_id, call, status)
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
            item = reasoning_item(self._item_id, text)
        else:
            yield self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=output_text_part(text))
            item = message_item(self._item_id, text)
        yield self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self._kind, self._text, self._call = None, "", None

    def _text_delta(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        if self._kind != kind:
            yield from self.close(set())
            yield from self._open(kind)
        self._text += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield self.event(delta_type, **self._where, content_index=0, delta=text, **extra)

    def _open(self, kind: str, call: ParsedToolCall | None = None) -> Iterator[dict[str, Any]]:
        self._kind, self._text = kind, ""
        if kind == "function_call":
            self._item_id, self._call, self._call_index = new_item_id("fc"), call, call.index
            item = function_call_item(self._item_id, call, "in_progress")
        elif kind == "reasoning":
            self._item_id = new_item_id("rs")
            item = reasoning_item(self._item_id, "", "in_progress")
        else:
            self._item_id = new_item_id("msg")
            item = message_item(self._item_id, "", "in_progress")
        yield self.event("response.output_item.added", output_index=len(self.output), item=item)
        if kind == "reasoning":
            yield self.event("response.content_part.added", **self._where, content_index=0,
                             part={"type": "reasoning_text", "text": ""})
        elif kind == "message":
            yield self.event("response.content_part.added", **self._where, content_index=0,
                             part=output_text_part(""))


async def create_response(request: Request) -> Response:
    return await serve_job(request, ResponsesRequest, ResponsesJob)


async def retrieve_response(request: Request) -> Response:
    return json_response(server_state(request).responses.get(request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    server_state(request).responses.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def routes() -> list[Route]:
    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])]
