"""Wire types of POST /v1/embeddings (OpenAI's shape, with vLLM's `truncate_prompt_tokens` and `normalize`), and
what a pooled vector becomes on the wire: Matryoshka truncation to `dimensions`, L2 normalisation, float or
base64 (little-endian float32, as the openai SDK decodes it; the SDK asks for base64 unless told otherwise).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mili_openai.protocol.errors import APIError

EMBEDDING_OBJECT, LIST_OBJECT = "embedding", "list"
MAX_INPUTS = 2048  # inputs in one request, as OpenAI's limit
ALL_TOKENS = -1  # truncate_prompt_tokens: -1 keeps the model's whole context (vLLM's meaning)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
EmbeddingInput = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds
                  | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])


class PoolingFields(BaseModel):
    """What every pooling endpoint takes besides its inputs."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    # vLLM's: keep each input's last k tokens (-1: the model's context); unset, an over-long input is a 400
    truncate_prompt_tokens: Annotated[int, Field(ge=ALL_TOKENS)] | None = None
    user: str | None = None

    def truncation(self, max_model_len: int) -> int | None:
        """How many tokens each input keeps at most (None: all, and longer ones are refused)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == ALL_TOKENS:
            return max_model_len
        if not 1 <= k <= max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the model's context), "
                                f"got {k}", param="truncate_prompt_tokens")
        return k


class EmbeddingRequest(PoolingFields):
    input: EmbeddingInput
    dimensions: Annotated[int, Field(ge=1)] | None = None  # Matryoshka: the first `dimensions` values, renormalised
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool | None = None  # vLLM's: None = the model's own (its sentence-transformers Normalize module)
    add_special_tokens: bool = True  # as vLLM's: text inputs tokenised with the tokenizer's special tokens

    def inputs(self) -> list[str | list[int]]:
        return inputs_of(self.input)


def inputs_of(value: str | list) -> list[str | list[int]]:
    """Each input of an `EmbeddingInput`, as text or token ids."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def embedding_response(response_id: str, created: int, model: str, vectors: list[list[float] | str],
                       prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": LIST_OBJECT,
        "created": created,
        "model": model,
        "data": [{"object": EMBEDDING_OBJECT, "index": index, "embedding": vector}
                 for index, vector in enumerate(vectors)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
