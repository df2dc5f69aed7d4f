"""The model runner's side of pooling: each pooling chunk's hidden states reduced to what the engine core folds
into the input's vector (engine/pooling_spec.py's `accumulate_pooled`), brought to the host.

A reranker (Qwen3-Reranker) scores the last position with two rows of the LM head, "no" and "yes" (vLLM
builds its Qwen3ForSequenceClassification the same way), never the whole vocabulary: the score is
softmax([no, yes])[yes], the model card's P("yes").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mili_openai.engine.pooling_spec import LAST, MEAN, RERANK, PoolingRow, PoolingSpec
from mili_openai.model.kernel_backend import MatmulFn


class Pooler:
    def __init__(self, spec: PoolingSpec, head_rows: torch.Tensor | None = None,
                 matmul: MatmulFn | None = None) -> None:
        """head_rows: a reranker's (2, hidden) LM-head rows of ("no", "yes"), in the weights' dtype, multiplied
        by `matmul`, the model's backend's (as the LM head is)."""
        if (spec.task == RERANK) != (head_rows is not None) or (head_rows is None) != (matmul is None):
            raise ValueError("a reranker's pooler needs its (no, yes) LM-head rows and the model's matmul, and only "
                             "a reranker's")
        self.spec = spec
        self.head_rows = head_rows
        self.matmul = matmul

    @classmethod
    def for_model(cls, spec: PoolingSpec, model: torch.nn.Module) -> Pooler:
        """The pooler of `spec` over `model`'s weights (a reranker's rows from its LM head, or its tied
        embedding)."""
        if spec.task != RERANK:
            return cls(spec)
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None) if head is not None else model.model.embed_tokens.weight
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError("a reranker needs a floating-point LM head (not a quantized one) for its yes/no rows")
        rows = torch.tensor(spec.score_token_ids, dtype=torch.long, device=weight.device)
        return cls(spec, weight.index_select(0, rows).contiguous(), model.backend.matmul)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, rows: Sequence[PoolingRow]) -> dict[int, np.ndarray]:
        """hidden (T, hidden) of the step -> {batch index: float32 vector} for the chunks that contribute one
        (see `accumulate_pooled`)."""
        pooling_type = self.spec.pooling_type
        out: dict[int, np.ndarray] = {}
        if pooling_type == MEAN:
            for row in rows:  # the sum in float32: a long input's bf16 sum would round away its tail
                out[row.batch_index] = hidden[row.row : row.row + row.length].float().sum(0).cpu().numpy()
            return out
        if pooling_type == LAST:
            picked = [(row.batch_index, row.row + row.length - 1) for row in rows if row.final]
        else:  # CLS: position 0, on the chunk that starts there
            picked = [(row.batch_index, row.row) for row in rows if row.start == 0]
        if not picked:
            return out
        index = torch.tensor([position for _, position in picked], dtype=torch.long, device=hidden.device)
        vectors = hidden.index_select(0, index)  # (N, hidden)
        if self.head_rows is not None:  # (N, 2) logits of (no, yes), in the weights' dtype as the LM head's
            logits = self.matmul(vectors, self.head_rows).float()
            vectors = torch.softmax(logits, dim=-1)[:, 1:]  # (N, 1): P(yes)
        vectors = vectors.float().cpu().numpy()
        return {batch_index: vectors[i] for i, (batch_index, _) in enumerate(picked)}
