"""Wire types of OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: the request, its
mapping onto a chat completion request, and the output items and response object.

A Responses request is a chat request in other clothes, so it runs the chat path: `input` (a string, or a
list of message / function_call / function_call_output / reasoning items, after the stored conversation
of `previous_response_id`) becomes chat messages, with `instructions` as the system message first;
function tools, `tool_choice`, `text.format`, `max_output_tokens`, `temperature` and `top_p` map onto
their chat fields (routes/responses.py serves the result); `input_image` parts (an image_url) become chat
`image_url` parts. What this server cannot do (built-in tools, files, background runs) is refused with a 400
that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mili_openai.protocol.chat import ChatCompletionRequest
from mili_openai.protocol.errors import APIError
from mili_openai.protocol.tool_calls import ParsedToolCall

TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "reasoning_text", "summary_text"})
INPUT_IMAGE = "input_image"
INCOMPLETE_FINISH_REASONS = {"length": "max_output_tokens"}  # engine finish reason -> incomplete_details.reason


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    """The fields this server reads; OpenAI's others (metadata, include, truncation, ...) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)  # as the chat request: "5" is not a number

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as on chat

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{index}]: only function tools are served here, not "
                                    f"{tool.get('type')!r}", param=f"tools[{index}].type")
            tools.append(FunctionTool.model_validate(tool))
        return tools

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items: a string is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def to_chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this runs as; `history`: the stored items of `previous_response_id`, if any."""
        if self.background:
            raise APIError(400, "background responses are not supported by this server", param="background")
        tools = self.function_tools()
        messages = chat_messages([*history, *self.input_items()])
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        chat: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs, "stream": self.stream,
        }
        if tools:
            chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict}}
        elif text_format is not None and text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        return ChatCompletionRequest.model_validate(chat)


# ---- input items -> chat messages ----
def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined; any other part is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise APIError(400, f"{where}: content parts of type {kind!r} are not supported (text only)",
                           param=f"{where}.content")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user/system message's content: text, or, when it holds `input_image` parts, chat content parts (text
    and `image_url`) in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == INPUT_IMAGE for p in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == INPUT_IMAGE:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}.content[{index}]: an input_image needs an image_url (file_id is not "
                                    "supported)", param=f"{where}.content")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}})
        else:
            parts.append({"type": "text", "text": _text_of([part], where)})
    return parts


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls join the assistant turn they follow, a
    reasoning item becomes the next assistant turn's `reasoning_content`, a call's output a tool message."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant_turn() -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            if role == "assistant":
                turn = assistant_turn()
                turn["content"] = (turn["content"] or "") + _text_of(item.get("content", ""), where)
            else:
                messages.append({"role": role, "content": _content_of(item.get("content", ""), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(400, f"{where}: a function_call needs call_id and name", param=where)
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs the call_id it answers", param=where)
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, where)
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type")
    for message in messages:  # an assistant turn of calls alone has no content
        if message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""
    return messages


# ---- output items and the response ----
def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text_part(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: ParsedToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def usage_object(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_object(response_id: str, created_at: int, model: str, request: ResponsesRequest, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The response as OpenAI shapes it; `status` in_progress, completed or incomplete."""
    incomplete = INCOMPLETE_FINISH_REASONS.get(finish_reason) if status == "incomplete" else None
    text_format = request.text.format if request.text is not None and request.text.format is not None else None
    return {
        "id": response_id, "object": "response", "created_at": created_at, "model": model, "status": status,
        "completed_at": int(time.time()) if status != "in_progress" else None,
        "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "metadata": {}, "output": output, "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": None, "store": request.store, "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                 else {"type": "text"}},
        "tool_choice": (request.tool_choice.model_dump() if isinstance(request.tool_choice, FunctionToolChoice)
                        else request.tool_choice or "auto"),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.function_tools()],
        "truncation": "disabled", "usage": usage, "user": None,
    }
