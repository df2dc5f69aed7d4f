"""LangChain's `ChatOpenAI` pointed at the server: invoke, stream and batch on the real engine (tiny
random checkpoint), and `bind_tools` with the tool call parsed back.

The tool-call test uses the scripted fake engine behind the real HTTP server, since random weights
do not write tool calls: it checks that what LangChain receives (streamed and not) becomes its
`tool_calls`.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from fake_engine import TOOL_CALL_TEXT, ScriptedEngine
from helpers_server import live_server
from mili_openai.config import ServerConfig
from mili_openai.server.app import create_app

MAX_TOKENS = 6


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


def chat_model(base_url: str, model: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="unused", model=model, max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def llm(real_server):
    return chat_model(real_server.api_base, "tiny-qwen3", temperature=0, max_tokens=MAX_TOKENS)


def test_invoke(llm):
    message = llm.invoke([HumanMessage("Say hello.")])
    assert isinstance(message, AIMessage) and isinstance(message.content, str)
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == MAX_TOKENS


def test_stream_matches_invoke(llm):
    whole = llm.invoke("Say hello.")
    chunks = list(llm.stream("Say hello."))
    assert "".join(chunk.content for chunk in chunks) == whole.content
    assert sum(chunks[1:], chunks[0]).response_metadata.get("finish_reason") == "length"


def test_batch(llm):
    results = llm.batch(["One.", "Two.", "Three."])
    assert len(results) == 3 and all(isinstance(r, AIMessage) for r in results)
    assert all(r.usage_metadata["output_tokens"] == MAX_TOKENS for r in results)


@pytest.fixture(scope="module")
def scripted_llm(qwen_tokenizer):
    engine = ScriptedEngine(qwen_tokenizer, script=TOOL_CALL_TEXT, max_model_len=1024)
    app = create_app(ServerConfig(served_model_name="scripted"), engine=engine)
    with live_server(app) as live:
        yield chat_model(live.api_base, "scripted", temperature=0).bind_tools([get_weather])


def test_bind_tools_parses_the_calls_back(scripted_llm):
    message = scripted_llm.invoke("Weather in Paris and Rome?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    # the calls go back into the history as the template expects
    follow_up = [HumanMessage("Weather?"), message,
                 *[ToolMessage(get_weather(**c["args"]), tool_call_id=c["id"]) for c in message.tool_calls]]
    assert scripted_llm.invoke(follow_up).tool_calls


def test_bind_tools_streamed(scripted_llm):
    chunks = list(scripted_llm.stream("Weather in Paris and Rome?"))
    merged = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert merged.content == "I will look it up."
