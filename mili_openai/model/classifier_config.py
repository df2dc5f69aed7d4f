"""What a `Qwen3ForSequenceClassification` checkpoint's config.json says about its head: transformers' class puts a
`score` linear of `num_labels` rows (no bias) on the last token's hidden state, in place of the LM head.

This is the layout vLLM serves rerankers in, and how Qwen3-Reranker is converted for it: one row, the "yes" row
of the LM head minus the "no" row, so that sigmoid(row . h) = softmax([no, yes])[yes]. A classifier of N labels
names them in `id2label`; transformers reads a config without it as 2 labels, LABEL_0 and LABEL_1.

The probabilities follow vLLM's classification pooler, which follows transformers' losses by `problem_type`:
regression -> the raw logits, multi-label -> a sigmoid per label, otherwise one label -> sigmoid, several ->
softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SEQUENCE_CLASSIFICATION = "Qwen3ForSequenceClassification"
DEFAULT_NUM_LABELS = 2  # transformers' PretrainedConfig default when config.json names no labels
SIGMOID, SOFTMAX, IDENTITY = "sigmoid", "softmax", "identity"
REGRESSION, MULTI_LABEL = "regression", "multi_label_classification"


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    labels: tuple[str, ...]  # id2label's names, by label id
    problem_type: str | None = None  # transformers' field: None, single_label_, multi_label_classification, regression

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a sequence classifier needs at least one label")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def activation(self) -> str:
        """What turns the head's logits into the served probabilities (SIGMOID, SOFTMAX or IDENTITY)."""
        if self.problem_type == REGRESSION:
            return IDENTITY
        if self.problem_type == MULTI_LABEL or self.num_labels == 1:
            return SIGMOID
        return SOFTMAX


def read_classifier(config: dict[str, Any]) -> ClassifierConfig | None:
    """The head of a `Qwen3ForSequenceClassification` config; None for any other architecture."""
    if SEQUENCE_CLASSIFICATION not in (config.get("architectures") or ()):
        return None
    id2label = config.get("id2label")
    if id2label:
        by_id = {int(key): str(name) for key, name in id2label.items()}
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"id2label must number the labels 0..{len(by_id) - 1}, got ids {sorted(by_id)}")
        labels = tuple(by_id[index] for index in range(len(by_id)))
    else:
        labels = tuple(f"LABEL_{index}" for index in range(int(config.get("num_labels") or DEFAULT_NUM_LABELS)))
    return ClassifierConfig(labels, config.get("problem_type"))
