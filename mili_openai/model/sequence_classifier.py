"""Qwen3ForSequenceClassification: Qwen3's body with transformers' `score` head (num_labels rows, no bias) in place
of the LM head (model/classifier_config.py). Only a pooling engine serves it: the head reads the last token's
hidden state of each input (engine/pooler.py), as transformers' class reads the last non-padding position.
"""

from __future__ import annotations

import torch

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.config import ModelConfig
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.layers import Linear
from mili_openai.model.qwen3 import Qwen3ForCausalLM


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, backend: KernelBackend, parallel: TensorParallelGroup | None = None) -> None:
        if config.classifier is None:
            raise ValueError("Qwen3ForSequenceClassification needs a classifier config (id2label / num_labels)")
        if parallel is not None:
            raise ValueError("a sequence-classification checkpoint runs on one rank: not with --tensor-parallel-size > 1")
        super().__init__(config, backend, parallel)
        self.lm_head = None  # the checkpoint has none; the score head reads the hidden state instead
        self.score = Linear(config.hidden_size, config.classifier.num_labels, self.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> the head's logits (N, num_labels) float32, in the weights' dtype like transformers
        (what a memory profile or a kernel warm-up runs through; pooling reads `score` itself)."""
        return self.score(hidden).float()
