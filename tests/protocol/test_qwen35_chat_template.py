"""Chat requests -> prompts with Qwen3.5's real template, exactly as transformers renders the same conversation
(its `apply_chat_template` on the messages as transformers documents them: tool-call arguments as objects), and
the reasoning split of what follows the prompt (the template opens `<think>` itself unless thinking is off)."""

from __future__ import annotations

import copy
import json

import pytest

from mili_openai.protocol.chat import ChatCompletionRequest
from mili_openai.protocol.chat_output import OutputOptions, parse_whole_output
from mili_openai.protocol.prompts import render_chat_text
from mili_openai.protocol.reasoning import output_reasoning_mode

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
# a multi-turn conversation as the OpenAI wire carries it: arguments as JSON text, parallel calls, tool answers,
# the model's earlier thinking, and values of several types
HISTORY = [
    {"role": "developer", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "text", "text": "Weather and time "}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools apply.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "hourly": true, '
                                                          '"fields": ["temp", "wind"], "unit": {"temp": "C"}}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "It is 18C and 14:05.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "20C"},
]


def as_transformers_messages(messages: list[dict]) -> list[dict]:
    """The same conversation as transformers' docs write it: arguments as objects, `system` for `developer`,
    content as one string."""
    out = copy.deepcopy(messages)
    for message in out:
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part["text"] for part in message["content"])
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def rendered(tokenizer, messages, tools=None, **template_kwargs) -> tuple[str, str]:
    body = {"messages": messages, "tools": tools}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    return render_chat_text(tokenizer, ChatCompletionRequest.model_validate(body))


CONVERSATIONS = {
    "one_turn": ([{"role": "user", "content": "hi"}], None),
    "system_and_tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                         [WEATHER_TOOL, TIME_TOOL]),
    "tool_history": (HISTORY, [WEATHER_TOOL, TIME_TOOL]),
    "history_then_user": ([*HISTORY, {"role": "assistant", "content": "Tomorrow: 20C."},
                           {"role": "user", "content": "Thanks"}], [WEATHER_TOOL]),
}


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_is_transformers_rendering_of_the_same_conversation(qwen35_tokenizer, name, thinking):
    messages, tools = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text, tail = rendered(qwen35_tokenizer, messages, tools, **kwargs)
    expected = qwen35_tokenizer.apply_chat_template(as_transformers_messages(messages), tools=tools, tokenize=False,
                                                    add_generation_prompt=True, **kwargs)
    assert text == expected
    # thinking is on unless turned off: the template opens the block itself, or writes an empty one
    assert tail == ("<think>\n\n</think>\n\n" if thinking is False else "<think>\n")
    assert output_reasoning_mode(tail) == ("off" if thinking is False else "open")


def test_history_renders_xml_calls_typed_values_and_grouped_tool_answers(qwen35_tokenizer):
    text, _ = rendered(qwen35_tokenizer, HISTORY, [WEATHER_TOOL, TIME_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert text.count("<|im_start|>system") == 1 and "</IMPORTANT>\n\nYou are helpful.<|im_end|>" in text
    assert ("Checking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n"
            '<parameter=fields>\n["temp", "wind"]\n</parameter>\n<parameter=unit>\n{"temp": "C"}\n</parameter>\n'
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n14:05\n"
            "</tool_response><|im_end|>") in text
    # thinking is kept only for the turns after the last user query
    assert "Two tools apply." not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                         "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user"
                         "\n<tool_response>\n20C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_reasoning_content_of_the_current_turn_is_rendered(qwen35_tokenizer):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]
    text, tail = render_chat_text(qwen35_tokenizer, ChatCompletionRequest.model_validate(
        {"messages": messages, "continue_final_message": True}))
    assert text.endswith("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4")
    assert tail == "<think>\nAdd them.\n</think>\n\n4"


OPTIONS = OutputOptions(split_reasoning=True, include_reasoning=True, parse_tools=False, max_calls=None)


def test_output_after_the_opened_think_block_splits_into_reasoning_and_answer(qwen35_tokenizer):
    _, tail = rendered(qwen35_tokenizer, [{"role": "user", "content": "hi"}])
    whole = parse_whole_output("The user greets me.\n</think>\n\nHello!", tail, OPTIONS)
    assert (whole.reasoning, whole.content) == ("The user greets me.", "Hello!")
    _, tail = rendered(qwen35_tokenizer, [{"role": "user", "content": "hi"}], enable_thinking=False)
    whole = parse_whole_output("Hello!", tail, OPTIONS)
    assert (whole.reasoning, whole.content) == ("", "Hello!")
