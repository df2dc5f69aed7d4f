"""Pooling checkpoints for the embedding and reranking tests: a tiny random Qwen3 with the sentence-transformers
files Qwen3-Embedding ships (`modules.json`, `1_Pooling/config.json`, a `2_Normalize` folder), and the oracles
that score them: sentence-transformers' own `encode`, and transformers' `Qwen3ForCausalLM` read at the reranker's
("no", "yes") rows as Qwen3-Reranker's model card does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mili_openai.model.checkpoint import TINY_SHAPE, build_random_checkpoint

ST_POOLING_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_sentence_transformers_files(directory: Path, pooling: str, normalize: bool = True,
                                      extra_modules: tuple[str, ...] = ()) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    for kind in extra_modules:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": kind, "type": kind})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    fields = {"word_embedding_dimension": TINY_SHAPE.hidden_size, "include_prompt": True,
              **{flag: name == pooling for name, flag in ST_POOLING_MODES.items()}}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(fields))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return directory


def build_embedding_checkpoint(directory: Path, pooling: str, seed: int, normalize: bool = True) -> Path:
    build_random_checkpoint(directory, TINY_SHAPE, seed)
    return write_sentence_transformers_files(directory, pooling, normalize)


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
