"""Wire types of the scoring endpoints: vLLM's POST /score (`text_1` / `text_2`, one-to-one, one-to-many or
pairwise) and the Jina/Cohere rerank shape vLLM serves at /rerank, /v1/rerank and /v2/rerank (query,
documents, `top_n`, `return_documents`, results sorted by `relevance_score`).

A reranker scores each (query, document) pair in Qwen3-Reranker's prompt (its model card's format, overridable
by `--rerank-template`); an embedding model scores a pair by the cosine of their embeddings, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from mili_openai.protocol.embeddings import MAX_INPUTS, PoolingFields
from mili_openai.protocol.errors import APIError

SCORE_OBJECT = "score"

Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoringFields(PoolingFields):
    # the reranker's task description (Qwen3-Reranker's "Instruct"); None = its model card's default
    instruction: str | None = None


class ScoreRequest(ScoringFields):
    text_1: Texts
    text_2: Texts

    def pairs(self) -> list[tuple[str, str]]:
        """One text_1 against every text_2, or text_1[i] against text_2[i]."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                                "many as text_2", param="text_2")
        return list(zip(first, second))


class RerankRequest(ScoringFields):
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True


def score_response(response_id: str, created: int, model: str, scores: list[float],
                   prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": index, "object": SCORE_OBJECT, "score": score} for index, score in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def rerank_response(response_id: str, model: str, body: RerankRequest, scores: list[float],
                    prompt_tokens: int) -> dict[str, Any]:
    """Results best first (ties in the documents' order), the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    return {"id": response_id, "model": model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
