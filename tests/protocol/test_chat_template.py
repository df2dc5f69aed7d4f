"""Messages -> prompt with the real Qwen3 chat template: tools, tool history, thinking, prefills."""

from __future__ import annotations

import asyncio

import pytest

from mili_openai.protocol.chat import ChatCompletionRequest
from mili_openai.protocol.prompts import render_chat_prompt, render_chat_text

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny.", "reasoning_content": "The tool said 18C."},
    {"role": "user", "content": "Thanks!"},
]


def request(**body) -> ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(body)


def test_tools_and_tool_history_render_as_qwen3_expects(qwen_tokenizer):
    text, tail = render_chat_text(qwen_tokenizer, request(messages=HISTORY, tools=[WEATHER_TOOL]))
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    # the JSON-string arguments of the history were parsed, so the template wrote them as an object
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert tail == ""


def test_dict_arguments_are_accepted_too(qwen_tokenizer):
    history = [dict(m) for m in HISTORY[:4]]
    history[2] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    text, _ = render_chat_text(qwen_tokenizer, request(messages=history, tools=[WEATHER_TOOL]))
    assert '"arguments": {"city": "Paris"}}' in text


def test_enable_thinking_false_closes_the_thinking_block_in_the_prompt(qwen_tokenizer):
    text, tail = render_chat_text(qwen_tokenizer, request(chat_template_kwargs={"enable_thinking": False}))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tail == "<think>\n\n</think>\n\n"


def test_tool_choice_leaves_the_prompt_as_the_template_renders_it(qwen_tokenizer):
    """"required" and named choices are held by a grammar (protocol/tool_calls.py), not a prefill."""
    required, tail = render_chat_text(qwen_tokenizer, request(tools=[WEATHER_TOOL], tool_choice="required"))
    assert tail == ""
    assert required == render_chat_text(qwen_tokenizer, request(tools=[WEATHER_TOOL], tool_choice="auto"))[0]


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(qwen_tokenizer):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    text, tail = render_chat_text(qwen_tokenizer, request(messages=messages, continue_final_message=True))
    assert text.endswith("One, two,") and tail.endswith("One, two,")


def test_token_ids_are_the_template_text_without_added_bos(qwen_tokenizer):
    rendered = asyncio.run(render_chat_prompt(qwen_tokenizer, request()))
    assert qwen_tokenizer.decode(rendered.token_ids) == rendered.text
    assert rendered.token_ids[0] == qwen_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_template_errors_become_value_errors_with_the_template_message(qwen_tokenizer):
    class RaisingTemplate:
        chat_template = "x"

        def apply_chat_template(self, *args, **kwargs):
            import jinja2

            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_text(RaisingTemplate(), request())
