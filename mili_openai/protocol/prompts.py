"""Prompts as the engine takes them: token ids, from text, token ids, or chat messages rendered with
the checkpoint tokenizer's own chat template; tokenisation of long texts kept off the event loop.

Chat: the Qwen3 template wants tool-call arguments as objects (it `tojson`s them) while OpenAI clients
send JSON strings, so history arguments are parsed here. `developer` is OpenAI's newer name for
`system`. A template that raises (the Qwen3 one does for an empty message list, others for
unsupported roles) is the client's problem: a 400 with the template's own message. `tool_choice`
"required" or a named function leaves the prompt as the template renders it: a grammar holds the
output to tool calls (protocol/tool_calls.py), so a thinking model may still think first.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import jinja2

from mili_openai.protocol.chat import ChatCompletionRequest, ChatMessage, ImagePart
from mili_openai.protocol.errors import APIError

# Texts longer than this are tokenised on a worker thread: the tokenizer releases the GIL, so the event
# loop streams meanwhile and concurrent prompts tokenise on several cores. Shorter ones are cheaper inline
# than the hop.
INLINE_TOKENIZE_CHARS = 2_048
# The rendered prompt's last assistant turn starts after this; what follows it (an opened `<think>`,
# an empty thinking block, a prefill) is the state the output continues from.
ASSISTANT_TURN_START = "<|im_start|>assistant\n"


async def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)


async def prompt_token_ids(tokenizer: Any, prompts: list[str | list[int]], vocab_size: int) -> list[list[int]]:
    """Each prompt as token ids; text is tokenised with the model's special tokens (like vLLM)."""
    out: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = await encode_text(tokenizer, prompt)
            if not ids:
                raise APIError(400, "the prompt is empty: at least one token is needed", param="prompt")
        else:
            ids = list(prompt)
            check_token_ids(ids, vocab_size)
        out.append(ids)
    return out


def prompt_text(tokenizer: Any, prompt: str | list[int]) -> str:
    """The prompt as text, for `echo` (token-id prompts are decoded)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False)


# ---- chat messages ----
# chat_template_kwargs may not override what the route itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "chat_template", "documents"}
)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    # The part of the assistant turn already written in the prompt (an opened or empty `<think>`
    # block, a prefill): the output continues it, so the reasoning and tool parsers start from it.
    assistant_tail: str


def _arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        raise ValueError(f"tool call arguments in the history are not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("tool call arguments in the history must be a JSON object")
    return parsed


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """One message as the template reads it."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.image_urls():  # the template writes each image's placeholder where its part sits
        out["content"] = [{"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                          for part in message.content]
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def render_chat_text(tokenizer: Any, request: ChatCompletionRequest) -> tuple[str, str]:
    """`(prompt text, assistant tail)`; ValueError (a 400) for anything the template refuses."""
    extra = dict(request.chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(extra)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}: use the request fields")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    try:
        text = tokenizer.apply_chat_template(
            [message_dict(m) for m in request.messages],
            tools=tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **extra,
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from None
    continues_assistant = request.add_generation_prompt or request.continue_final_message
    tail = text.rsplit(ASSISTANT_TURN_START, 1)[-1] if continues_assistant and ASSISTANT_TURN_START in text else ""
    return text, tail


async def render_chat_prompt(tokenizer: Any, request: ChatCompletionRequest) -> RenderedPrompt:
    """The prompt text, its token ids (the template already wrote every special token) and tail."""
    text, tail = render_chat_text(tokenizer, request)
    token_ids = await encode_text(tokenizer, text, add_special_tokens=False)
    return RenderedPrompt(text, list(token_ids), tail)
