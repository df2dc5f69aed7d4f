"""The model runner's side of pooling: each pooling chunk's hidden states reduced to what the engine core folds
into the input's vector (engine/pooling_spec.py's `accumulate_pooled`), brought to the host.

A reranker (Qwen3-Reranker) scores the last position with two rows of the LM head, "no" and "yes" (vLLM
builds its Qwen3ForSequenceClassification the same way), never the whole vocabulary: the score is
softmax([no, yes])[yes], the model card's P("yes"). A sequence classifier scores the last position with its own
`score` head (model/sequence_classifier.py), its logits turned into probabilities by the checkpoint's activation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mili_openai.engine.pooling_spec import CLASSIFY, EMBED, LAST, MEAN, RERANK, PoolingRow, PoolingSpec
from mili_openai.model.classifier_config import IDENTITY, SIGMOID, SOFTMAX
from mili_openai.model.kernel_backend import KernelBackend

ACTIVATIONS = {SIGMOID: torch.sigmoid, SOFTMAX: lambda logits: torch.softmax(logits, dim=-1),
               IDENTITY: lambda logits: logits}


class Pooler:
    def __init__(self, spec: PoolingSpec, head_rows: torch.Tensor | None = None,
                 backend: KernelBackend | None = None) -> None:
        """head_rows, in the weights' dtype: a reranker's (2, hidden) LM-head rows of ("no", "yes"), or a
        classifier's (num_labels, hidden) score head, multiplied by the model's `backend`'s matmul (as the LM head
        is; read at each call, so CPU kernels that come in later reach the head too)."""
        if (spec.task != EMBED) != (head_rows is not None) or (head_rows is None) != (backend is None):
            raise ValueError("a reranker's or classifier's pooler needs its head rows and the model's backend, and "
                             "only theirs")
        self.spec = spec
        self.head_rows = head_rows
        self.backend = backend

    @classmethod
    def for_model(cls, spec: PoolingSpec, model: torch.nn.Module) -> Pooler:
        """The pooler of `spec` over `model`'s weights (a reranker's rows from its LM head, or its tied
        embedding; a classifier's score head)."""
        if spec.task == EMBED:
            return cls(spec)
        if spec.task == CLASSIFY:
            weight = getattr(getattr(model, "score", None), "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise ValueError("a sequence classifier's model needs its score head")
            return cls(spec, weight, model.backend)
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None) if head is not None else model.model.embed_tokens.weight
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError("a reranker needs a floating-point LM head (not a quantized one) for its yes/no rows")
        rows = torch.tensor(spec.score_token_ids, dtype=torch.long, device=weight.device)
        return cls(spec, weight.index_select(0, rows).contiguous(), model.backend)

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
        if self.head_rows is not None:  # (N, rows) logits, in the weights' dtype as transformers' heads
            logits = self.backend.matmul(vectors, self.head_rows).float()
            if self.spec.task == RERANK:
                vectors = torch.softmax(logits, dim=-1)[:, 1:]  # (N, 1): P(yes) of (no, yes)
            else:
                vectors = ACTIVATIONS[self.spec.activation](logits)  # (N, num_labels)
        vectors = vectors.float().cpu().numpy()
        return {batch_index: vectors[i] for i, (batch_index, _) in enumerate(picked)}
