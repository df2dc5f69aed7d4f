"""Qwen3ForSequenceClassification checkpoints through the pooling runner, against transformers' own class in
float32: a converted Qwen3-Reranker (one label, the LM head's yes-minus-no row, scored by sigmoid) and a head of
three labels (softmax). Inputs run batched, chunked (a long one over several steps) and behind a cached prefix,
and each way must give the probabilities transformers gives one prompt at a time.

What the checkpoint's config says (labels, activation) and how the served task is chosen are tested on their own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pooling_helpers import transformers_classifier_probs, transformers_rerank_scores

from mili_openai.config import EngineConfig
from mili_openai.engine.llm import LLM
from mili_openai.engine.pooling_setup import resolve_pooling
from mili_openai.engine.pooling_spec import QWEN3_RERANK_TEMPLATE, PoolingSpec, render_pair
from mili_openai.model import ModelConfig
from mili_openai.model.checkpoint import TINY_SHAPE, config_dict
from mili_openai.model.classifier_config import ClassifierConfig, read_classifier

TOLERANCE = 1e-4  # the bar for scores
# a small budget, so the long text runs in several chunks, and one step holds several short inputs
ENGINE_ARGS = dict(dtype="float32", num_pages=64, page_size=16, max_num_batched_tokens=32, max_model_len=256)
# over a page (16 tokens) long, so the second time it is a prefix-cache hit
PREFIX = ("Instruct: Given a customer review of a product bought online, say whether the customer feels good, "
          "bad or indifferent about it\nReview: ")
TEXTS = ["a", "hello world", "The quick brown fox jumps over the lazy dog. " * 8, "向量检索 works well",
         PREFIX + "great value, would buy again", PREFIX + "it broke after two days"]
QUERY = "what is a radix tree?"
DOCUMENTS = ["A radix tree shares prefixes.", "Bananas are yellow.", "Paged attention reads K/V via page tables. " * 3]
SEQUENCE_CLASSIFICATION = ["Qwen3ForSequenceClassification"]


# ---- what the config says ----
def test_read_classifier_takes_id2label_or_transformers_defaults():
    assert read_classifier({"architectures": ["Qwen3ForCausalLM"]}) is None
    named = read_classifier({"architectures": SEQUENCE_CLASSIFICATION, "id2label": {"1": "yes", "0": "no"}})
    assert (named.labels, named.activation) == (("no", "yes"), "softmax")
    default = read_classifier({"architectures": SEQUENCE_CLASSIFICATION})  # transformers' num_labels=2
    assert default.labels == ("LABEL_0", "LABEL_1")
    assert read_classifier({"architectures": SEQUENCE_CLASSIFICATION, "num_labels": 1}).activation == "sigmoid"
    with pytest.raises(ValueError, match="number the labels"):
        read_classifier({"architectures": SEQUENCE_CLASSIFICATION, "id2label": {"0": "a", "2": "b"}})


@pytest.mark.parametrize(("problem_type", "labels", "activation"), [
    (None, ("a",), "sigmoid"), ("single_label_classification", ("a", "b"), "softmax"),
    ("multi_label_classification", ("a", "b"), "sigmoid"), ("regression", ("a",), "identity")])
def test_activation_follows_the_problem_type(problem_type, labels, activation):
    assert ClassifierConfig(labels, problem_type).activation == activation


def classifier_config(**fields) -> ModelConfig:
    return ModelConfig.from_dicts({**config_dict(TINY_SHAPE, torch.float32), "architectures": SEQUENCE_CLASSIFICATION,
                                   **fields})


def test_the_architecture_is_served_for_qwen3_only():
    config = classifier_config(id2label={"0": "LABEL_0"})
    assert config.architecture == "Qwen3ForSequenceClassification" and config.classifier.num_labels == 1
    with pytest.raises(ValueError, match="not supported for model_type 'qwen3_moe'"):
        classifier_config(model_type="qwen3_moe")


def test_a_classifier_checkpoint_pools_and_refuses_other_tasks(tmp_path, qwen_tokenizer):
    config = classifier_config(id2label={"0": "neg", "1": "pos"})
    spec = resolve_pooling(EngineConfig(), tmp_path, config, qwen_tokenizer)  # runner auto: it pools
    assert (spec.task, spec.labels, spec.activation, spec.output_size) == ("classify", ("neg", "pos"), "softmax", 2)
    assert not spec.scores_pairs and spec.uses_prefix_cache
    for refused in (dict(runner="generate"), dict(runner="pooling", pooling_task="embed"),
                    dict(runner="pooling", pooling_task="rerank"), dict(runner="pooling", pooling_type="mean")):
        with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
            resolve_pooling(EngineConfig(**refused), tmp_path, config, qwen_tokenizer)
    causal = ModelConfig.from_dicts(config_dict(TINY_SHAPE, torch.float32))
    with pytest.raises(ValueError, match="needs a Qwen3ForSequenceClassification"):
        resolve_pooling(EngineConfig(runner="pooling", pooling_task="classify"), tmp_path, causal, qwen_tokenizer)


def test_a_spec_keeps_labels_to_classifiers():
    with pytest.raises(ValueError, match="only a classifier"):
        PoolingSpec("embed", "last", normalize=True, hidden_size=8, labels=("a",), activation="sigmoid")
    with pytest.raises(ValueError, match="last token"):
        PoolingSpec("classify", "mean", normalize=False, hidden_size=8, labels=("a",), activation="sigmoid")


# ---- against transformers ----
@pytest.fixture(scope="module", params=["reranker", "labels"])
def classifier(request, classifier_checkpoint, qwen_tokenizer):
    """(LLM on the checkpoint, its token ids of TEXTS, transformers' probabilities of them)."""
    checkpoint = classifier_checkpoint(request.param)
    llm = LLM(str(checkpoint), **ENGINE_ARGS)
    prompts = [qwen_tokenizer.encode(text) for text in TEXTS]
    yield llm, prompts, transformers_classifier_probs(checkpoint, prompts)
    llm.core.check_integrity()


def test_probabilities_match_transformers_batched_chunked_and_one_by_one(classifier):
    llm, prompts, reference = classifier
    batched = [output.outputs.probs for output in llm.classify(prompts)]
    np.testing.assert_allclose(batched, reference, atol=TOLERANCE)
    one_by_one = [llm.classify(prompt)[0].outputs.probs for prompt in prompts]
    np.testing.assert_allclose(one_by_one, batched, atol=1e-5)
    assert llm.core.scheduler.running == [] and not llm.core.scheduler.waiting  # nothing left behind


def test_a_cached_prefix_gives_the_same_probabilities(classifier):
    llm, prompts, reference = classifier
    llm.classify(prompts[-2:])
    hits = llm.core.stats().prefix_cache_hits_total
    again = [output.outputs.probs for output in llm.classify(prompts[-2:])]
    assert llm.core.stats().prefix_cache_hits_total > hits  # the shared instruction's pages were reused
    np.testing.assert_allclose(again, reference[-2:], atol=TOLERANCE)


def test_the_converted_reranker_scores_as_the_reranker_it_came_from(classifier_checkpoint, tiny_checkpoint,
                                                                   qwen_tokenizer):
    llm = LLM(str(classifier_checkpoint("reranker")), **ENGINE_ARGS)
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS)]
    prompts = [qwen_tokenizer.encode(render_pair(QWEN3_RERANK_TEMPLATE, QUERY, document, None),
                                     add_special_tokens=False) for document in DOCUMENTS]
    no, yes = qwen_tokenizer.convert_tokens_to_ids(["no", "yes"])
    # sigmoid(yes - no) of the classifier = softmax([no, yes])[yes] of the causal model: one score, two routes
    reference = transformers_rerank_scores(tiny_checkpoint, prompts, no, yes)
    np.testing.assert_allclose(scores, reference, atol=TOLERANCE)
    np.testing.assert_allclose(scores, np.ravel(transformers_classifier_probs(classifier_checkpoint("reranker"),
                                                                               prompts)), atol=TOLERANCE)
    llm.core.check_integrity()


def test_only_a_one_label_classifier_scores_pairs_and_no_classifier_embeds(classifier):
    llm, prompts, _ = classifier
    if len(llm.core.info.pooling.labels) == 1:
        assert len(llm.score(QUERY, DOCUMENTS)) == len(DOCUMENTS)
    else:
        with pytest.raises(ValueError, match="score needs"):
            llm.score(QUERY, DOCUMENTS)
    with pytest.raises(ValueError, match="embed needs"):
        llm.embed(prompts[0])
