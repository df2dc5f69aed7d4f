"""Qwen3ForSequenceClassification checkpoints through a real uvicorn: vLLM's POST /classify (probabilities and
the most likely label per input), a converted reranker (one label) through /score, /v1/rerank and /v2/rerank, a
classifier of three labels refused where a pair needs one score; /v1/models saying what each model does; and the
pooling counters of /metrics.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers_server import served_engine
from pooling_helpers import transformers_classifier_probs

TOLERANCE = 1e-4
MAX_MODEL_LEN = 128
ENGINE_ARGS = dict(num_pages=64, page_size=16, max_num_batched_tokens=64, max_num_seqs=16,
                   max_model_len=MAX_MODEL_LEN)
TEXTS = ["great value, would buy again", "it broke after two days", "向量检索"]
DOCUMENTS = ["A radix tree shares prefixes.", "Bananas are yellow.", "Tries store strings by prefix."]
LABELS = ("negative", "neutral", "positive")  # conftest's CLASSIFIER_LABELS


@pytest.fixture(scope="module")
def labels_server(classifier_checkpoint):
    with served_engine(classifier_checkpoint("labels"), **ENGINE_ARGS) as (live, engine):
        yield live, engine


@pytest.fixture(scope="module")
def reranker_server(classifier_checkpoint):
    with served_engine(classifier_checkpoint("reranker"), **ENGINE_ARGS) as (live, _):
        yield live


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=60)


def pooling_counters(live) -> dict[tuple[str, str], float]:
    """{(metric name, api label): value} of the pooling counters in /metrics."""
    text = httpx.get(live.base_url + "/metrics").text
    return {(sample.name, sample.labels["api"]): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("mili_pooling_") and sample.name.endswith("_total")}


def test_classify_matches_transformers_and_names_the_likeliest_label(labels_server, classifier_checkpoint):
    live, engine = labels_server
    response = post(live, "/classify", {"model": "tiny", "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("classify-")
    prompts = [engine.info.tokenizer.encode(text) for text in TEXTS]
    reference = transformers_classifier_probs(classifier_checkpoint("labels"), prompts)
    np.testing.assert_allclose([item["probs"] for item in body["data"]], reference, atol=TOLERANCE)
    assert [item["label"] for item in body["data"]] == [LABELS[int(np.argmax(probs))] for probs in reference]
    assert [(item["index"], item["num_classes"]) for item in body["data"]] == [(0, 3), (1, 3), (2, 3)]
    tokens = sum(len(prompt) for prompt in prompts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    as_ids = post(live, "/v1/classify", {"input": prompts[0]}).json()  # token ids, the /v1 path
    np.testing.assert_allclose(as_ids["data"][0]["probs"], body["data"][0]["probs"], atol=1e-6)


def test_a_one_label_classifier_scores_and_reranks(reranker_server):
    scores = [item["score"] for item in post(reranker_server, "/score", {"text_1": "radix tree?",
                                                                        "text_2": DOCUMENTS}).json()["data"]]
    assert all(0.0 < score < 1.0 for score in scores)
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    for path in ("/v1/rerank", "/v2/rerank"):
        results = post(reranker_server, path, {"query": "radix tree?", "documents": DOCUMENTS}).json()["results"]
        assert [result["index"] for result in results] == order
        assert [result["relevance_score"] for result in results] == pytest.approx([scores[i] for i in order],
                                                                                  abs=1e-6)
    one = post(reranker_server, "/classify", {"input": "radix tree?"}).json()["data"][0]
    assert one["num_classes"] == 1 and one["label"] == "LABEL_0" and 0.0 < one["probs"][0] < 1.0


def test_models_say_what_a_classifier_does(labels_server, reranker_server):
    live, _ = labels_server
    model = httpx.get(live.base_url + "/v1/models").json()["data"][0]
    assert model["task"] == "classify"
    assert model["pooling"] == {"type": "last", "normalize": False, "dimensions": 3, "endpoints": ["/classify"],
                                "labels": list(LABELS)}
    reranker = httpx.get(reranker_server.base_url + "/v1/models").json()["data"][0]["pooling"]
    assert reranker["endpoints"] == ["/classify", "/score", "/v1/rerank"] and reranker["labels"] == ["LABEL_0"]


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/score", {"text_1": "q", "text_2": "d"}, "model", "3 labels"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, "model", "use /classify"),
    ("/v1/embeddings", {"input": "x"}, "model", "sequence classifier"),
    ("/classify", {"input": "word " * (MAX_MODEL_LEN + 8)}, "input", "maximum context length"),
    ("/classify", {"input": []}, "input", ""),
    ("/classify", {"input": [[1, 2], [10**9]]}, "input", ""),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ""),
])
def test_what_a_classifier_cannot_serve_is_a_400(labels_server, path, body, param, message):
    live, _ = labels_server
    response = post(live, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"]


def test_metrics_count_pooling_requests_inputs_and_prompt_tokens(reranker_server):
    live = reranker_server
    before = pooling_counters(live)
    assert ("mili_pooling_requests_total", "embeddings") in before  # every API's series exists from the start
    classified = post(live, "/classify", {"input": ["one", "two words"]}).json()
    reranked = post(live, "/v1/rerank", {"query": "q", "documents": DOCUMENTS}).json()
    scored = post(live, "/score", {"text_1": "q", "text_2": "d"}).json()
    after = pooling_counters(live)

    def grew(name: str, api: str) -> float:
        return after[(name, api)] - before[(name, api)]

    assert [grew("mili_pooling_requests_total", api) for api in ("classify", "rerank", "score", "embeddings")] == [
        1, 1, 1, 0]
    assert [grew("mili_pooling_inputs_total", api) for api in ("classify", "rerank", "score")] == [2, 3, 1]
    assert grew("mili_pooling_prompt_tokens_total", "classify") == classified["usage"]["prompt_tokens"]
    assert grew("mili_pooling_prompt_tokens_total", "rerank") == reranked["usage"]["prompt_tokens"]
    assert grew("mili_pooling_prompt_tokens_total", "score") == scored["usage"]["prompt_tokens"]
