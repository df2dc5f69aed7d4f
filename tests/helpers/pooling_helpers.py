"""Pooling checkpoints for the embedding, reranking and classification tests: a tiny random Qwen3 with the
sentence-transformers files Qwen3-Embedding ships (`modules.json`, `1_Pooling/config.json`, a `2_Normalize` folder),
a Qwen3ForSequenceClassification made from a causal checkpoint (a converted reranker's yes-minus-no row, or a
head of several labels), and the oracles that score them: sentence-transformers' own `encode`, transformers'
`Qwen3ForCausalLM` read at the reranker's ("no", "yes") rows as Qwen3-Reranker's model card does, and transformers'
`Qwen3ForSequenceClassification`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mili_openai.model.checkpoint import (
    QWEN3_BOS_TOKEN_ID,
    TINY_SHAPE,
    build_random_checkpoint,
    write_sentence_transformers_files,
)
from mili_openai.model.weights import LM_HEAD


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


def build_sequence_classifier(source: Path, directory: Path, head: torch.Tensor, labels: tuple[str, ...]) -> Path:
    """`source`'s body as a Qwen3ForSequenceClassification at `directory`: its config's architecture and labels,
    its weights without the LM head, `head` (num_labels, hidden) as `score.weight`, its tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copyfile(file, directory / file.name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], id2label=dict(enumerate(labels)),
                  label2id={label: index for index, label in enumerate(labels)}, pad_token_id=QWEN3_BOS_TOKEN_ID)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: tensor for name, tensor in load_file(str(source / "model.safetensors")).items()
               if name != LM_HEAD}
    save_file({**weights, "score.weight": head.contiguous()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def yes_minus_no_row(checkpoint: Path, no_id: int, yes_id: int) -> torch.Tensor:
    """(1, hidden): how Qwen3-Reranker converts to a one-label classifier, its LM head's (or tied embedding's)
    "yes" row minus its "no" row, so that sigmoid(row . h) = softmax([no, yes])[yes]."""
    weights = load_file(str(checkpoint / "model.safetensors"))
    head = weights.get(LM_HEAD, weights["model.embed_tokens.weight"])
    return (head[yes_id] - head[no_id]).unsqueeze(0)


def transformers_classifier_probs(checkpoint: Path, prompts: list[list[int]]) -> list[list[float]]:
    """transformers' Qwen3ForSequenceClassification in float32, one prompt at a time: its logits at the last
    position, through the activation vLLM's classifier applies (sigmoid for one label, softmax for several)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    probs = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0]
            probs.append((torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)).tolist())
    return probs
