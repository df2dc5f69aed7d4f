"""The drafts' logits: the drafting model's LM head over the whole vocabulary, or, with a token map
(`"token_map"` in the speculative config, as SGLang's `--speculative-token-map`; FR-Spec's frequency-ranked
draft vocabulary), over the mapped token ids only, the others -inf.

A small model's LM head is a large part of what a draft costs: at Qwen3.5-0.8B's shape (248K x 1024) each MTP
draft reads 0.5 GB for the head beside 40 MB for its layer. Drafting over the tokens a model mostly emits cuts
that read in proportion; the target still verifies every draft, so the output is the same, and a token outside
the map is only never drafted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

UNQUANTIZED = (torch.float32, torch.bfloat16, torch.float16)  # LM head weights a token map slices


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids of a token-map file (a JSON list of ids), sorted; ValueError names what is wrong."""
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative token_map {path!r}: not a readable JSON list of token ids ({exc})") from exc
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"speculative token_map {path!r}: must be a non-empty JSON list of token ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"speculative token_map {path!r}: ids must be in [0, {vocab_size}), "
                         f"got {min(ids)}..{max(ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"speculative token_map {path!r}: repeats token ids")
    return torch.tensor(sorted(ids), dtype=torch.int64)


class DraftHead:
    """hidden (N, H) -> the draft logits (N, vocab) float32 of `model` (a Qwen3 / Qwen3.5 causal LM)."""

    def __init__(self, model, token_ids: torch.Tensor | None = None) -> None:
        self.model = model
        self.token_ids = self.weight = None
        if token_ids is None:
            return
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        weight = getattr(head, "weight", None)  # a quantized head keeps packed rows instead
        if weight is None or weight.dtype not in UNQUANTIZED or getattr(model, "parallel", None) is not None:
            raise ValueError("speculative token_map: not with a quantized LM head or tensor parallelism yet")
        self.vocab_size = weight.shape[0]
        self.token_ids = token_ids.to(weight.device)
        self.weight = weight[self.token_ids].contiguous()  # (mapped, H): the rows read per draft

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            return self.model.compute_logits(hidden)
        logits = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)
        logits[:, self.token_ids] = self.model.compute_logits(hidden, self.weight)
        return logits
