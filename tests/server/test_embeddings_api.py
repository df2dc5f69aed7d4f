"""The pooling endpoints through a real uvicorn: POST /v1/embeddings with the openai SDK (float and base64) and
LangChain's OpenAIEmbeddings, /v1/rerank and /v2/rerank in the Jina/Cohere shape, vLLM's /score; and the
4xx every bad input gets, in OpenAI's error shape.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from helpers_server import asgi_client, served_engine
from pooling_helpers import sentence_transformers_vectors

COSINE_FLOOR = 0.9999
MAX_MODEL_LEN = 128
ENGINE_ARGS = dict(num_pages=64, page_size=16, max_num_batched_tokens=64, max_num_seqs=16,
                   max_model_len=MAX_MODEL_LEN)
TEXTS = ["hello world", "Paged attention reads K/V through page tables.", "向量检索"]
DOCUMENTS = ["A radix tree shares prefixes.", "Bananas are yellow.", "Tries store strings by prefix."]


@pytest.fixture(scope="module")
def embed_server(embedding_checkpoint):
    with served_engine(embedding_checkpoint("last"), **ENGINE_ARGS) as (live, engine):
        yield live, engine


@pytest.fixture(scope="module")
def rerank_server(tiny_checkpoint):
    with served_engine(tiny_checkpoint, runner="pooling", pooling_task="rerank", **ENGINE_ARGS) as (live, _):
        yield live


def client_of(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=60)


def test_openai_sdk_embeddings_float_and_base64_match_sentence_transformers(embed_server, embedding_checkpoint):
    live, engine = embed_server
    client = client_of(live)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes it
    vectors = np.array([item.embedding for item in floats.data], dtype=np.float32)
    np.testing.assert_array_equal(np.array([item.embedding for item in decoded.data], dtype=np.float32), vectors)
    assert [item.index for item in floats.data] == [0, 1, 2] and floats.model == "tiny"
    tokens = sum(len(engine.info.tokenizer.encode(text)) for text in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (tokens, tokens)
    reference = sentence_transformers_vectors(embedding_checkpoint("last"), TEXTS).numpy()
    cos = (vectors * reference).sum(-1) / np.linalg.norm(vectors, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert cos.min() >= COSINE_FLOOR
    raw = post(live, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    values = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(values, vectors[0], atol=1e-6)  # alone, not in a batch: rounding may differ


def test_token_id_inputs_dimensions_and_normalize(embed_server):
    live, engine = embed_server
    ids = [engine.info.tokenizer.encode(text) for text in TEXTS[:2]]
    client = client_of(live)
    as_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    as_text = client.embeddings.create(model="tiny", input=TEXTS[:2], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in as_ids.data], [d.embedding for d in as_text.data], atol=1e-6)
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, as_text.data[0].embedding, atol=1e-6)
    short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    assert np.linalg.norm(short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    raw = post(live, "/v1/embeddings", {"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    assert np.linalg.norm(raw) != pytest.approx(1.0, abs=1e-3)
    np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), as_text.data[0].embedding, atol=1e-5)


def test_langchain_openai_embeddings(embed_server):
    from langchain_openai import OpenAIEmbeddings

    live, _ = embed_server
    # check_embedding_ctx_length=False: send the texts, not tiktoken's token ids of another vocabulary
    embeddings = OpenAIEmbeddings(model="tiny", base_url=live.api_base, api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[0])
    reference = client_of(live).embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(documents, [d.embedding for d in reference.data], atol=1e-6)
    np.testing.assert_allclose(query, documents[0], atol=1e-6)


def test_score_on_an_embedding_model_is_the_cosine(embed_server):
    live, _ = embed_server
    vectors = [d.embedding for d in client_of(live).embeddings.create(
        model="tiny", input=[TEXTS[0], *DOCUMENTS], encoding_format="float").data]
    one = post(live, "/score", {"text_1": TEXTS[0], "text_2": DOCUMENTS[0]}).json()
    many = post(live, "/score", {"text_1": TEXTS[0], "text_2": DOCUMENTS}).json()
    expected = [float(np.dot(vectors[0], vector)) for vector in vectors[1:]]
    assert [item["score"] for item in many["data"]] == pytest.approx(expected, abs=1e-5)
    assert one["data"][0]["score"] == pytest.approx(expected[0], abs=1e-5) and one["data"][0]["object"] == "score"
    assert many["usage"]["prompt_tokens"] > 0


def test_models_say_what_the_model_does(embed_server, rerank_server):
    live, _ = embed_server
    model = httpx.get(live.base_url + "/v1/models").json()["data"][0]
    assert model["task"] == "embed"
    assert model["pooling"] == {"type": "last", "normalize": True, "dimensions": 64,
                                "endpoints": ["/v1/embeddings", "/score", "/v1/rerank"]}
    reranker = httpx.get(rerank_server.base_url + "/v1/models").json()["data"][0]
    assert reranker["task"] == "rerank" and reranker["pooling"]["endpoints"] == ["/score", "/v1/rerank"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "word " * (MAX_MODEL_LEN + 8)}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], [10**9]]}, "input"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
])
def test_bad_embedding_input_is_a_400(embed_server, body, param):
    live, _ = embed_server
    response = post(live, "/v1/embeddings", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_truncation_serves_an_over_long_input(embed_server):
    live, _ = embed_server
    body = {"input": "word " * (MAX_MODEL_LEN + 8), "truncate_prompt_tokens": 8}
    assert post(live, "/v1/embeddings", body).json()["usage"]["prompt_tokens"] == 8
    body["truncate_prompt_tokens"] = -1
    assert post(live, "/v1/embeddings", body).json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_generation_on_a_pooling_server_and_wrong_model_are_refused(embed_server):
    live, _ = embed_server
    chat = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "does not generate" in chat.json()["error"]["message"]
    assert post(live, "/v1/completions", {"prompt": "hi"}).status_code == 400
    assert post(live, "/v1/embeddings", {"model": "other", "input": "x"}).status_code == 404


@pytest.mark.anyio
async def test_pooling_endpoints_on_a_generative_server_are_a_400(fake_engine):
    async with asgi_client(fake_engine) as client:
        embedding = await client.post("/v1/embeddings", json={"input": "x"})
        rerank = await client.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        classify = await client.post("/classify", json={"input": "x"})
    assert embedding.status_code == 400 and "generative model" in embedding.json()["error"]["message"]
    assert rerank.status_code == 400
    assert classify.status_code == 400 and "generative model" in classify.json()["error"]["message"]


def test_rerank_is_sorted_cut_to_top_n_and_matches_score(rerank_server):
    scores = [item["score"] for item in post(rerank_server, "/score", {"text_1": "radix tree?",
                                                                      "text_2": DOCUMENTS}).json()["data"]]
    assert all(0.0 < score < 1.0 for score in scores)
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        body = post(rerank_server, path, {"query": "radix tree?", "documents": DOCUMENTS, "top_n": 2}).json()
        results = body["results"]
        assert len(results) == 2 and body["usage"]["total_tokens"] > 0
        order = sorted(range(len(scores)), key=lambda index: -scores[index])[:2]
        assert [result["index"] for result in results] == order
        assert [result["relevance_score"] for result in results] == pytest.approx([scores[i] for i in order], abs=1e-6)
        assert results[0]["document"] == {"text": DOCUMENTS[order[0]]}
    bare = post(rerank_server, "/v1/rerank", {"query": "q", "documents": DOCUMENTS, "return_documents": False})
    assert len(bare.json()["results"]) == 3 and "document" not in bare.json()["results"][0]


def test_rerank_errors(rerank_server):
    assert post(rerank_server, "/v1/rerank", {"query": "q", "documents": []}).status_code == 400
    assert post(rerank_server, "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}).status_code == 400
    mismatched = post(rerank_server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"
    embedding = post(rerank_server, "/v1/embeddings", {"input": "x"})
    assert embedding.status_code == 400 and "reranker" in embedding.json()["error"]["message"]


def test_classify_needs_a_sequence_classifier(embed_server, rerank_server):
    for live in (embed_server[0], rerank_server):
        refused = post(live, "/classify", {"input": "x"})
        assert refused.status_code == 400 and "sequence-classification" in refused.json()["error"]["message"]
