"""Pooling checkpoints for the embedding and reranking tests: a tiny random Qwen3 with the sentence-transformers
files Qwen3-Embedding ships (`modules.json`, `1_Pooling/config.json`, a `2_Normalize` folder), and the oracles
that score them: sentence-transformers' own `encode`, and transformers' `Qwen3ForCausalLM` read at the reranker's
("no", "yes") rows as Qwen3-Reranker's model card does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mili_openai.model.checkpoint import TINY_SHAPE, build_random_checkpoint, write_sentence_transformers_files


def build_embedding_checkpoint(directory: Path, pooling: str, seed: int, normalize: bool = True) -> Path:
    build_random_checkpoint(directory, TINY_SHAPE, seed)
    return write_sentence_transformers_files(directory, pooling, TINY_SHAPE.hidden_size, normalize)


def sentence_transformers_vectors(checkpoint: Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' `encode` of `texts` (float32, each normalised as the checkpoint's modules say)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(checkpoint), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def transformers_rerank_scores(checkpoint: Path, prompts: list[list[int]], no_id: int, yes_id: int) -> list[float]:
    """P("yes") over ("no", "yes") at each prompt's last position, by transformers' Qwen3ForCausalLM in float32
    (Qwen3-Reranker's model card, one prompt at a time: no padding to reason about)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, -1]
            pair = torch.stack([logits[no_id], logits[yes_id]])
            scores.append(torch.softmax(pair, dim=0)[1].item())
    return scores
