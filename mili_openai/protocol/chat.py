"""Wire types of `POST /v1/chat/completions`: the request (validated) and the response shapes.

Field names are OpenAI's; vLLM's sampling extras are accepted too. Content parts are text and `image_url`
(a model with a vision tower reads them: protocol/image_loading.py); anything this server cannot do is refused
with a 400 that says so (audio parts, for one) rather than silently ignored. Unknown top-level fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mili_openai.engine.sampling_params import MAX_LOGPROBS
from mili_openai.protocol.sampling import PromptLogprobsField, SamplingFields, StreamOptions, check_prompt_logprobs

Role = Literal["system", "developer", "user", "assistant", "tool"]
ToolChoiceMode = Literal["none", "auto", "required"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is accepted too


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(_Lenient):
    url: str = Field(min_length=1)
    # "low": at most LOW_DETAIL_PIXELS (engine/image_processor.py), fewer tokens; else the checkpoint's bounds
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


CONTENT_PARTS = {"text": TextPart, "image_url": ImagePart}


def _content_parts(parts: list[Any]) -> list[TextPart | ImagePart]:
    """Text and image parts; refuse any other kind."""
    result = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in CONTENT_PARTS:
            raise ValueError(f"content parts of type {kind!r} are not supported: only 'text' and 'image_url' are")
        result.append(CONTENT_PARTS[kind].model_validate(part))
    return result


class ChatMessage(_Lenient):
    role: Role
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only
    reasoning_content: str | None = None  # assistant history from a reasoning model

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        return _content_parts(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs content (null only for assistant tool calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages can carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined, no content = "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[ImageURL]:
        return [part.image_url for part in self.content or () if isinstance(part, ImagePart)]


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """The sampling fields shared with /v1/completions (OpenAI's and vLLM's), plus the chat ones."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # chat's default: up to the context length
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name, preferred
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream_options: StreamOptions | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM: false drops the thinking text from the response
    prompt_logprobs: PromptLogprobsField = None  # vLLM's: scores of the rendered prompt, on the response
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
            self.add_generation_prompt = False  # asking to continue implies no new assistant turn
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        tool_names = {tool.function.name for tool in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in tool_names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, "
                             "which is not among the request's tools")
        if self.tool_choice == "required" and not tool_names:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ----
def now_s() -> int:
    return int(time.time())


class FunctionOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text, under the name newer clients read
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM extra: the stop string or token id that ended it


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[Choice]
    usage: UsageOut
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None

    def to_event(self) -> dict[str, Any]:
        """The chunk as sent: deltas carry only the fields they set, everything else in full."""
        event = self.model_dump()
        for choice, model_choice in zip(event["choices"], self.choices, strict=True):
            choice["delta"] = model_choice.delta.model_dump(exclude_none=True)
        return event


def text_chunk_event(response_id: str, created: int, model: str, index: int, content: str | None,
                     reasoning: str | None, finish_reason: str | None, stop_reason: str | int | None,
                     with_usage_key: bool, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`ChatCompletionChunk.to_event()` of one choice whose delta carries text only (no role, tool calls nor
    usage), built as a dict: most chunks of a stream, where the models would cost every token many times what
    the dict does. `with_usage_key`: keep the "usage": null that include_usage streams send. `logprobs`: the
    choice's logprobs object as sent (protocol/logprobs.py `chat_logprobs_object`)."""
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = delta["reasoning"] = reasoning
    event = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    if with_usage_key:
        event["usage"] = None
    return event
