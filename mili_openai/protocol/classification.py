"""Wire types of vLLM's POST /classify: a sequence classifier's label probabilities for each input
(`input` as for /v1/embeddings: a string, strings, token ids or lists of them), each with its most likely label.
"""

from __future__ import annotations

from typing import Any

from mili_openai.protocol.embeddings import EmbeddingInput, PoolingFields, inputs_of

CLASSIFICATION_OBJECT = "list"


class ClassificationRequest(PoolingFields):
    input: EmbeddingInput
    add_special_tokens: bool = True  # as vLLM's: text inputs tokenised with the tokenizer's special tokens

    def inputs(self) -> list[str | list[int]]:
        return inputs_of(self.input)


def classification_response(response_id: str, created: int, model: str, labels: tuple[str, ...],
                            probabilities: list[list[float]], prompt_tokens: int) -> dict[str, Any]:
    """Per input, its probabilities by label id and the label of the highest (the first of ties)."""
    data = [{"index": index, "label": labels[max(range(len(probs)), key=probs.__getitem__)], "probs": probs,
             "num_classes": len(probs)} for index, probs in enumerate(probabilities)]
    return {"id": response_id, "object": CLASSIFICATION_OBJECT, "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}}
