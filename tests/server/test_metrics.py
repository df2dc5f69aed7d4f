"""GET /metrics on a real uvicorn: it parses, stays open without the API key, and moves with the load.

Each test gets a fresh app (fresh collectors) around one module-wide engine on the tiny checkpoint,
so counts start at zero and can be compared exactly with what the test sent.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers_server import REAL_ENGINE_CONFIG, TEST_MODEL_NAME, live_server, wait_until
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app

API_KEY = "metrics-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = " ".join(f"token{i}" for i in range(40))  # several 16-token pages: cacheable
NUM_CONCURRENT = 8


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **REAL_ENGINE_CONFIG))


@pytest.fixture
def server(engine):
    app = create_app(ServerConfig(served_model_name=TEST_MODEL_NAME, api_key=API_KEY, request_timeout_s=60.0),
                     engine=engine)
    with live_server(app) as live:
        yield live


def scrape(base_url: str) -> dict[str, list]:
    response = httpx.get(base_url + "/metrics")  # no API key: scrapers do not carry one
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(matching)


def complete(base_url: str, prompt: str, max_tokens: int = 6, **extra) -> dict:
    body = {"model": TEST_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    response = httpx.post(base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_metrics_is_open_and_lists_engine_series(server):
    assert httpx.get(server.base_url + "/v1/models").status_code == 401  # the key is really required
    samples = scrape(server.base_url)
    for name in ("mili_num_requests_running", "mili_num_requests_waiting", "mili_kv_cache_usage_ratio",
                 "mili_prompt_tokens_total", "mili_generation_tokens_total", "mili_prefix_cache_hits_total",
                 "mili_time_to_first_token_seconds_count"):
        assert name in samples, name


def test_token_counters_add_up_to_usage(server):
    before = scrape(server.base_url)
    usages = [complete(server.base_url, f"Counting tokens, round {i}", max_tokens=3 + i)["usage"] for i in range(3)]
    body = {"model": TEST_MODEL_NAME, "prompt": "streamed one", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usages.append(httpx.Response(200, content=lines[-1][len("data: "):]).json()["usage"])
    after = scrape(server.base_url)
    prompt_delta = value(after, "mili_prompt_tokens_total") - value(before, "mili_prompt_tokens_total")
    generated_delta = value(after, "mili_generation_tokens_total") - value(before, "mili_generation_tokens_total")
    assert prompt_delta == sum(u["prompt_tokens"] for u in usages)
    assert generated_delta == sum(u["completion_tokens"] for u in usages) == 3 + 4 + 5 + 5


def test_prefix_cache_hits_rise_on_a_repeated_prompt(server):
    complete(server.base_url, LONG_PROMPT, max_tokens=2)
    before = scrape(server.base_url)
    repeated = complete(server.base_url, LONG_PROMPT, max_tokens=2)
    after = scrape(server.base_url)
    hits = value(after, "mili_prefix_cache_hits_total") - value(before, "mili_prefix_cache_hits_total")
    queries = value(after, "mili_prefix_cache_queries_total") - value(before, "mili_prefix_cache_queries_total")
    cached = repeated["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and hits == cached
    assert queries >= hits


def test_gauges_return_to_zero_and_histograms_count_every_request(server):
    async def load():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            bodies = [{"model": TEST_MODEL_NAME, "prompt": f"concurrent {i}", "max_tokens": 8, "ignore_eos": True,
                       "stream": i % 2 == 0} for i in range(NUM_CONCURRENT)]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(load())
    assert [r.status_code for r in responses] == [200] * NUM_CONCURRENT

    def idle() -> bool:
        samples = scrape(server.base_url)
        return value(samples, "mili_num_requests_running") == 0 == value(samples, "mili_num_requests_waiting")

    assert wait_until(idle)
    samples = scrape(server.base_url)
    # a fresh app: its histograms saw exactly these sequences
    assert value(samples, "mili_time_to_first_token_seconds_count") == NUM_CONCURRENT
    assert value(samples, "mili_e2e_request_latency_seconds_count") == NUM_CONCURRENT
    assert value(samples, "mili_requests_finished_total", finish_reason="length") == NUM_CONCURRENT
    assert value(samples, "mili_kv_cache_pages") == REAL_ENGINE_CONFIG["num_pages"]


def test_http_requests_are_counted_by_route_template(server):
    complete(server.base_url, "counted")
    httpx.get(server.base_url + "/status/some-request-id", headers=AUTH)
    httpx.get(server.base_url + "/status/another-request-id", headers=AUTH)
    httpx.get(server.base_url + "/no/such/route", headers=AUTH)
    httpx.get(server.base_url + "/v1/models")  # 401: no key
    samples = scrape(server.base_url)
    name = "mili_http_requests_total"
    assert value(samples, name, method="POST", path="/v1/completions", status="200") == 1
    assert value(samples, name, method="GET", path="/status/{request_id}", status="404") == 2
    assert value(samples, name, method="GET", path="unmatched", status="404") == 1
    assert value(samples, name, method="GET", path="/v1/models", status="401") == 1
    paths = {s.labels["path"] for s in samples[name]}
    assert not any("request-id" in p or "/no/such" in p for p in paths)  # raw URLs never become labels
