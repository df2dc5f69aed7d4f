"""Small pieces the sampler tests share: a sampler over a 32-token vocabulary, rows and logits."""

from __future__ import annotations

import torch

from mili_openai.engine.sampler import Sampler, SamplingRow
from mili_openai.engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 7
CPU = torch.device("cpu")


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
