"""What a pooling model returns per input (`PoolingSpec`, in `EngineInfo`), and how the vector of an input is
built from the prefill chunks that compute it (`PoolingRow`, `accumulate_pooled`). No torch here: the API side
imports it.

A pooling request is a prompt run through the model once, prefill only: no token is sampled, and its pages go
back to the pool (the full ones into the radix tree) as soon as its last chunk ran. The runner reduces each
chunk's hidden states (engine/pooler.py); the engine core folds the chunks of one input together here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mili_openai.config import POOLING_TYPES

LAST, MEAN, CLS = POOLING_TYPES
EMBED, RERANK, CLASSIFY = "embed", "rerank", "classify"
SERVED_TASKS = (EMBED, RERANK, CLASSIFY)  # what a PoolingSpec is (config.py's POOLING_TASKS adds "auto")
NORM_FLOOR = 1e-12  # a zero vector stays zero instead of dividing by zero (torch's F.normalize eps)
# Qwen3-Reranker's model card: the system prompt, the pair, and an empty thinking block; the model then
# answers "yes" or "no", and the score is P("yes")
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
TEMPLATE_FIELDS = ("{instruction}", "{query}", "{document}")


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """The served pooling model: what one input becomes."""

    # EMBED: the pooled hidden state; RERANK: P("yes") at the last token (Qwen3-Reranker); CLASSIFY: the
    # probabilities of a Qwen3ForSequenceClassification's labels at the last token
    task: str
    pooling_type: str  # LAST, MEAN or CLS: which hidden states make the vector (RERANK, CLASSIFY: always LAST)
    normalize: bool  # the checkpoint's default (a sentence-transformers Normalize module): L2-normalise vectors
    hidden_size: int  # an embedding's length before any Matryoshka truncation
    # RERANK: the ("no", "yes") token ids whose LM-head rows score an input; None for EMBED
    score_token_ids: tuple[int, int] | None = None
    labels: tuple[str, ...] = ()  # CLASSIFY: the head's labels, by label id (id2label); empty otherwise
    activation: str | None = None  # CLASSIFY: sigmoid, softmax or identity (model/classifier_config.py)

    def __post_init__(self) -> None:
        if self.task not in SERVED_TASKS:
            raise ValueError(f"pooling task must be one of {SERVED_TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if (self.task == RERANK) != (self.score_token_ids is not None):
            raise ValueError("a reranker, and only a reranker, scores with its (no, yes) token ids")
        if (self.task == CLASSIFY) != bool(self.labels) or (self.task == CLASSIFY) != (self.activation is not None):
            raise ValueError("a classifier, and only a classifier, has labels and an activation")
        if self.task != EMBED and self.pooling_type != LAST:
            raise ValueError(f"a {self.task} model reads the last token: its pooling type must be {LAST}")

    @property
    def output_size(self) -> int:
        """Floats the engine returns per input: the hidden size, one score, or a probability per label."""
        if self.task == CLASSIFY:
            return len(self.labels)
        return 1 if self.task == RERANK else self.hidden_size

    @property
    def scores_pairs(self) -> bool:
        """Whether a (query, document) pair run through the model gives its score: a reranker, or a classifier
        of one label (a converted Qwen3-Reranker). An embedding model scores pairs by cosine instead."""
        return self.task == RERANK or (self.task == CLASSIFY and len(self.labels) == 1)

    @property
    def uses_prefix_cache(self) -> bool:
        """Last-token pooling reads only the last position, which is always computed: a cached prefix serves
        it. Mean and CLS pooling read every position (or the first), so their inputs compute all of them."""
        return self.pooling_type == LAST

    def describe(self) -> str:
        if self.task == RERANK:
            return f"reranker: P(yes) over (no, yes) tokens {self.score_token_ids} at the last token"
        if self.task == CLASSIFY:
            return f"sequence classifier: {self.activation} over {len(self.labels)} labels at the last token"
        return f"embeddings of {self.hidden_size} dimensions, {self.pooling_type}-token pooling" + (
            ", L2-normalised" if self.normalize else "")


@dataclass(frozen=True, slots=True)
class PoolingRow:
    """A prefill chunk of a pooling input in a step: hidden rows [row, row + length) hold its positions
    [start, start + length); `final`: the chunk ends the input."""

    batch_index: int  # the sequence's place in the step's batch
    row: int
    length: int
    start: int
    final: bool


def accumulate_pooled(partial: Any, part: np.ndarray | None, row: PoolingRow, pooling_type: str,
                      num_tokens: int) -> tuple[Any, np.ndarray | None]:
    """(the input's partial state after this chunk, its vector once `row.final`). The runner's `part` for a
    chunk: LAST, the last position's output on the final chunk; MEAN, the chunk's sum; CLS, position 0's output
    on the chunk that starts there. A chunk from position 0 starts over (a preempted input recomputes)."""
    if row.start == 0:
        partial = None
    if pooling_type == MEAN:
        partial = part if partial is None else partial + part
        return partial, (partial / num_tokens if row.final else None)
    if pooling_type == CLS and row.start == 0:
        partial = part
    if not row.final:
        return partial, None
    return partial, (part if pooling_type == LAST else partial)


def finish_vector(vector: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    """The pooled vector as served: its first `dimensions` values (Matryoshka), then L2-normalised if asked."""
    out = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        if dimensions > out.shape[0]:
            raise ValueError(f"dimensions must be at most {out.shape[0]}, the model's embedding size")
        out = out[:dimensions]
    if normalize:
        out = out / max(float(np.linalg.norm(out)), NORM_FLOOR)
    return out


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity of two vectors (an embedding model's score of a pair, as vLLM's)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denominator = max(math.sqrt(float(x @ x) * float(y @ y)), NORM_FLOOR)
    return float(x @ y) / denominator


def render_pair(template: str, query: str, document: str, instruction: str | None) -> str:
    """One (query, document) pair in the reranker's prompt. Plain replacement, not str.format: the texts and
    the template may hold braces of their own."""
    values = (instruction or DEFAULT_RERANK_INSTRUCTION, query, document)
    text = template
    for field, value in zip(TEMPLATE_FIELDS, values):
        text = text.replace(field, value)
    return text
