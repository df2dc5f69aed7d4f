"""`mili bench serve`'s request bodies and configuration checks."""

from __future__ import annotations

import json
import math

import pytest

from mili_openai.bench.config import BenchConfig
from mili_openai.bench.datasets import build_shared_prefix_requests
from mili_openai.bench.sse_client import request_body
from mili_openai.bench.prompt_tokens import PromptBuilder


def test_chat_body_uses_system_message_for_prefix(bench_tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(bench_tokenizer, 0), 2, 1, 20, 5, 3)
    body = request_body(BenchConfig(endpoint="chat"), "m", requests[1])
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == requests[1].prefix.text
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body and "min_tokens" not in body and "prompt" not in body


def test_body_options_ids_ignore_eos_extra_body(bench_tokenizer):
    requests = build_shared_prefix_requests(PromptBuilder(bench_tokenizer, 0), 1, 1, 20, 5, 3, as_ids=True)
    config = BenchConfig(prompt_as_ids=True, ignore_eos=True, min_tokens=2,
                         extra_body='{"generation_config": "{}", "temperature": 0.5}')
    body = request_body(config, "m", requests[0])
    assert body["prompt"] == list(requests[0].prefix.token_ids) + list(requests[0].body.token_ids)
    assert body["ignore_eos"] is True and body["min_tokens"] == 2
    assert body["generation_config"] == "{}" and body["temperature"] == 0.5
    assert body["max_tokens"] == 3


@pytest.mark.parametrize("kwargs", [
    dict(endpoint="embeddings"), dict(dataset="sharegpt"), dict(num_requests=0), dict(concurrency=0),
    dict(request_rate=0.0), dict(request_rate=math.nan), dict(endpoint="chat", prompt_as_ids=True),
    dict(extra_body="[1]"), dict(extra_body="{bad"), dict(timeout_s=0), dict(base_url="localhost:8000"),
    dict(min_tokens=65, output_len=64), dict(dataset_path="conversations.json"),
    dict(dataset="sharegpt", dataset_path="c.json", sharegpt_output_len=0),
    dict(burstiness=0), dict(burstiness=math.inf), dict(random_range_ratio=1.0), dict(random_range_ratio=-0.1),
    dict(min_tokens=40, output_len=64, random_range_ratio=0.5),  # a drawn max_tokens may be 32
    dict(model="a", models=("b", "c")), dict(models=("a", "")),
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**kwargs)


def test_config_json_hides_api_key_and_spells_inf():
    data = BenchConfig(api_key="secret").to_json()
    assert data["api_key"] == "***" and data["request_rate"] == "inf"
    json.dumps(data)  # strictly JSON-serialisable
