"""The pooling runner: embeddings and rerank scores through the engine (prefill only, nothing sampled), against
sentence-transformers and transformers on the same random weights, in float32.

Inputs run batched (several in one step), chunked (a long input over several steps under a small token
budget) and behind a cached prefix; each way must give the one-by-one vectors. The bookkeeping that folds
chunks together (`accumulate_pooled`) and the checkpoint detection are tested on their own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pooling_helpers import sentence_transformers_vectors, transformers_rerank_scores

from mili_openai.config import EngineConfig
from mili_openai.engine.contract import EngineInfo, RequestError, check_pooling_request, check_request
from mili_openai.engine.llm import LLM
from mili_openai.engine.pooling_setup import resolve_pooling
from mili_openai.engine.pooling_spec import (
    DEFAULT_RERANK_INSTRUCTION,
    QWEN3_RERANK_TEMPLATE,
    PoolingRow,
    PoolingSpec,
    accumulate_pooled,
    finish_vector,
    render_pair,
)
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.model import ModelConfig
from mili_openai.model.checkpoint import TINY_SHAPE, write_sentence_transformers_files
from mili_openai.model.pooling_config import read_checkpoint_pooling

COSINE_FLOOR = 0.9999  # the bar per vector
SCORE_TOLERANCE = 1e-4
# a small budget, so the long text runs in several chunks, and one step holds several short inputs
ENGINE_ARGS = dict(dtype="float32", num_pages=64, page_size=16, max_num_batched_tokens=32, max_model_len=256)
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog. " * 8, "Qwen3 embeddings, 向量检索",
         INSTRUCTION + "what is a radix tree?", INSTRUCTION + "how do paged KV caches work?"]


def cosines(ours: list[list[float]], reference: torch.Tensor) -> list[float]:
    ours_t = torch.tensor(ours, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(ours_t, reference, dim=-1).tolist()


# ---- the bookkeeping ----
def row(start: int, length: int, final: bool) -> PoolingRow:
    return PoolingRow(batch_index=0, row=0, length=length, start=start, final=final)


def test_mean_folds_chunk_sums_and_a_recompute_starts_over():
    parts = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]
    partial, vector = accumulate_pooled(None, parts[0], row(0, 2, False), "mean", 4)
    assert vector is None
    # a preempted input recomputes from position 0: the sum restarts
    partial, vector = accumulate_pooled(partial, parts[0], row(0, 2, False), "mean", 4)
    partial, vector = accumulate_pooled(partial, parts[1], row(2, 2, True), "mean", 4)
    np.testing.assert_allclose(vector, [1.0, 1.5])


def test_cls_keeps_the_first_chunks_vector_and_last_takes_the_final_one():
    first, last = np.array([1.0]), np.array([9.0])
    partial, _ = accumulate_pooled(None, first, row(0, 4, False), "cls", 8)
    assert accumulate_pooled(partial, None, row(4, 4, True), "cls", 8)[1] == first
    assert accumulate_pooled(None, last, row(4, 4, True), "last", 8)[1] == last


def test_finish_vector_truncates_then_normalises():
    vector = finish_vector([3.0, 4.0, 12.0], 2, normalize=True)
    np.testing.assert_allclose(vector, [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(finish_vector([3.0, 4.0], None, normalize=False), [3.0, 4.0])
    with pytest.raises(ValueError, match="at most 3"):
        finish_vector([1.0, 2.0, 3.0], 4, normalize=True)


def test_render_pair_keeps_braces_and_uses_the_default_instruction():
    text = render_pair(QWEN3_RERANK_TEMPLATE, "q {x}", "d {y}", None)
    assert f"<Instruct>: {DEFAULT_RERANK_INSTRUCTION}\n<Query>: q {{x}}\n<Document>: d {{y}}<|im_end|>" in text


# ---- the contract ----
def info(pooling: PoolingSpec | None) -> EngineInfo:
    return EngineInfo(tokenizer=None, model_path=None, max_model_len=16, vocab_size=100, eos_token_ids=(0,),
                      quantization=None, sampling_defaults={}, pooling=pooling)


EMBED_SPEC = PoolingSpec("embed", "last", normalize=True, hidden_size=8)


def test_pooling_requests_take_the_whole_context_and_truncate_when_asked():
    assert len(check_pooling_request(list(range(16)), info(EMBED_SPEC)).prompt_token_ids) == 16
    with pytest.raises(RequestError, match="maximum context length is 16") as refused:
        check_pooling_request(list(range(17)), info(EMBED_SPEC))
    assert refused.value.param == "input"
    assert check_pooling_request(list(range(20)), info(EMBED_SPEC), truncate_to=4).prompt_token_ids == [16, 17, 18, 19]


def test_generation_and_pooling_requests_are_refused_by_the_other_kind_of_model():
    with pytest.raises(RequestError, match="does not generate"):
        check_request([1, 2], SamplingParams(), info(EMBED_SPEC))
    with pytest.raises(RequestError, match="generative model"):
        check_pooling_request([1, 2], info(None))


# ---- what a checkpoint says ----
def test_checkpoint_pooling_is_read_from_modules_json(tmp_path):
    assert read_checkpoint_pooling(tmp_path) is None
    write_sentence_transformers_files(tmp_path, "mean", TINY_SHAPE.hidden_size, normalize=False)
    pooling = read_checkpoint_pooling(tmp_path)
    assert (pooling.pooling_type, pooling.normalize) == ("mean", False)
    write_sentence_transformers_files(tmp_path, "last", TINY_SHAPE.hidden_size,
                                      extra_modules=("sentence_transformers.models.Dense",))
    with pytest.raises(ValueError, match="Dense"):
        read_checkpoint_pooling(tmp_path)


def test_resolve_pooling_follows_the_flags_over_the_checkpoint(tmp_path, qwen_tokenizer):
    config = ModelConfig.from_dicts({**_tiny_config()})
    assert resolve_pooling(EngineConfig(), tmp_path, config, qwen_tokenizer) is None  # no modules.json: generate
    spec = resolve_pooling(EngineConfig(runner="pooling"), tmp_path, config, qwen_tokenizer)
    assert (spec.task, spec.pooling_type, spec.normalize) == ("embed", "last", True)
    write_sentence_transformers_files(tmp_path, "cls", TINY_SHAPE.hidden_size)
    assert resolve_pooling(EngineConfig(), tmp_path, config, qwen_tokenizer).pooling_type == "cls"
    assert resolve_pooling(EngineConfig(pooling_type="mean"), tmp_path, config, qwen_tokenizer).pooling_type == "mean"
    rerank = resolve_pooling(EngineConfig(runner="pooling", pooling_task="rerank"), tmp_path, config, qwen_tokenizer)
    no, yes = qwen_tokenizer.convert_tokens_to_ids(["no", "yes"])
    assert rerank.score_token_ids == (no, yes) and rerank.output_size == 1
    with pytest.raises(ValueError, match="apply to a pooling model"):
        resolve_pooling(EngineConfig(runner="generate", pooling_type="mean"), tmp_path, config, qwen_tokenizer)


def _tiny_config() -> dict:
    from mili_openai.model.checkpoint import config_dict

    return config_dict(TINY_SHAPE, torch.float32)


# ---- against sentence-transformers ----
@pytest.fixture(scope="module", params=["last", "mean", "cls"])
def embedder(request, embedding_checkpoint):
    checkpoint = embedding_checkpoint(request.param)
    llm = LLM(str(checkpoint), **ENGINE_ARGS)
    yield llm, sentence_transformers_vectors(checkpoint, TEXTS)
    llm.core.check_integrity()


def test_embeddings_match_sentence_transformers_batched_chunked_and_one_by_one(embedder):
    llm, reference = embedder
    batched = [output.outputs.embedding for output in llm.embed(TEXTS)]
    assert min(cosines(batched, reference)) >= COSINE_FLOOR
    one_by_one = [llm.embed(text)[0].outputs.embedding for text in TEXTS]
    np.testing.assert_allclose(np.array(one_by_one), np.array(batched), atol=1e-5)
    assert llm.core.scheduler.running == [] and not llm.core.scheduler.waiting  # nothing left behind


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_input_whose_last_chunk_is_one_token_is_pooled(embedding_checkpoint, pooling):
    """A budget that leaves one token of an input for the next step: that step pools it as a prefill chunk
    (a one-token chunk was once scheduled as a decode row, which the runner does not pool, and the engine loop
    died on it)."""
    checkpoint = str(embedding_checkpoint(pooling))
    whole = LLM(checkpoint, **ENGINE_ARGS)
    tokens = whole.core.tokenizer.encode(TEXTS[2])
    expected = whole.embed([tokens])[0].outputs.embedding
    chunked = LLM(checkpoint, **{**ENGINE_ARGS, "max_num_batched_tokens": len(tokens) - 1})
    np.testing.assert_allclose(chunked.embed([tokens])[0].outputs.embedding, expected, atol=1e-5)
    chunked.core.check_integrity()


def test_a_cached_instruction_prefix_gives_the_same_vectors(embedding_checkpoint):
    llm = LLM(str(embedding_checkpoint("last")), **ENGINE_ARGS)
    first = [output.outputs.embedding for output in llm.embed(TEXTS[-2:])]
    hits = llm.core.stats().prefix_cache_hits_total
    again = [output.outputs.embedding for output in llm.embed(TEXTS[-2:])]
    assert llm.core.stats().prefix_cache_hits_total > hits  # the instruction's pages were reused
    np.testing.assert_allclose(np.array(again), np.array(first), atol=1e-5)
    llm.core.check_integrity()


def test_matryoshka_dimensions_and_normalize(embedding_checkpoint):
    llm = LLM(str(embedding_checkpoint("last")), **ENGINE_ARGS)
    whole = np.array(llm.embed("hello", normalize=False)[0].outputs.embedding)
    short = np.array(llm.embed("hello", dimensions=16)[0].outputs.embedding)
    np.testing.assert_allclose(short, whole[:16] / np.linalg.norm(whole[:16]), rtol=1e-5)


# ---- the reranker against transformers ----
def test_rerank_scores_match_transformers_yes_no_probability(tiny_checkpoint, qwen_tokenizer):
    llm = LLM(str(tiny_checkpoint), runner="pooling", pooling_task="rerank", **ENGINE_ARGS)
    query, documents = "what is a radix tree?", ["A radix tree shares prefixes.", "Bananas are yellow.",
                                                  "Paged attention reads K/V through page tables. " * 3]
    scores = [output.outputs.score for output in llm.score(query, documents)]
    # the model card's prompt: prefix, the pair and suffix tokenised apart, then joined
    prefix, rest = QWEN3_RERANK_TEMPLATE.split("<Instruct>")
    body, suffix = ("<Instruct>" + rest).split("<|im_end|>", 1)
    prompts = []
    for document in documents:
        pair = body.replace("{instruction}", DEFAULT_RERANK_INSTRUCTION).replace("{query}", query)
        pair = pair.replace("{document}", document)
        prompts.append([token for part in (prefix, pair, "<|im_end|>" + suffix)
                        for token in qwen_tokenizer.encode(part, add_special_tokens=False)])
    no, yes = qwen_tokenizer.convert_tokens_to_ids(["no", "yes"])
    reference = transformers_rerank_scores(tiny_checkpoint, prompts, no, yes)
    np.testing.assert_allclose(scores, reference, atol=SCORE_TOLERANCE)
    assert np.argsort(scores).tolist() == np.argsort(reference).tolist()
    llm.core.check_integrity()
