"""Small pieces the sampler tests share: a sampler over a 32-token vocabulary, rows and logits, and the
references the draws and cuts are held to."""

from __future__ import annotations

import torch

from mili_openai.engine.sampler import Sampler, SamplingRow
from mili_openai.engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 7
CPU = torch.device("cpu")
NUM_DRAWS = 4000  # rows of one batch for frequency checks
# Chi-square critical value, 2 degrees of freedom, p = 0.001: a correct sampler fails 1 time in 1000
# seeds, and the seed is fixed, so the test is deterministic.
CHI2_CRITICAL_DF2 = 13.82


def make_sampler(seed: int = 0, vocab: int = VOCAB) -> Sampler:
    return Sampler(vocab_size=vocab, eos_token_ids=[EOS], device=CPU, seed=seed)


def row(params: SamplingParams | None = None, prompt=(1, 2, 3), output=(), generator=None) -> SamplingRow:
    params = params or SamplingParams()
    if generator is None and params.seed is not None:
        generator = Sampler.make_generator(params.seed, CPU)
    return SamplingRow(params=params, generator=generator, prompt_token_ids=list(prompt), output_token_ids=list(output))


def logits_from_probs(probs: list[float], vocab: int = VOCAB) -> torch.Tensor:
    """(1, vocab) logits whose softmax is `probs` on the first tokens and ~0 elsewhere."""
    logits = torch.full((1, vocab), -1e4)
    logits[0, : len(probs)] = torch.tensor(probs).log()
    return logits


def random_logits(batch: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def reference_kept(row_logits: torch.Tensor, k: int, p: float) -> set[int]:
    """Top-k then top-p by the definition, one row, with a full sort in float64."""
    order = row_logits.double().sort(descending=True).indices.tolist()[:k]
    probs = torch.softmax(row_logits.double()[order], dim=0).tolist()
    kept_ids, mass = [], 0.0
    for token, prob in zip(order, probs):
        if kept_ids and mass >= p:
            break
        kept_ids.append(token)
        mass += prob
    return set(kept_ids)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))
