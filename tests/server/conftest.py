"""The server tests' shared fixture: `client`, the openai SDK on the server the module names as `api_base`
(test_chat_server.py's tests run again in other modules, each against its own server)."""

from __future__ import annotations

import openai
import pytest

from helpers_server import sdk_client


@pytest.fixture(scope="module")
def client(api_base) -> openai.OpenAI:
    return sdk_client(api_base)
