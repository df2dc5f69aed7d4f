"""The compiled sampling kernel (temperature, top-k/top-p/min-p, inverse-CDF draw) against the torch
path's definitions, and the sampler that uses it; skipped where the CPU cannot run the kernels."""

from __future__ import annotations

import math

import pytest
import torch

from sampler_helpers import CHI2_CRITICAL_DF2, CPU, EOS, NUM_DRAWS, VOCAB, chi_square, logits_from_probs, row
from sampler_helpers import reference_kept

from mili_openai import LLM
from mili_openai.engine import logits_processing as lp
from mili_openai.engine.sampler import Sampler
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.kernels import cpu_supports_kernels

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")

LARGE_VOCAB = 20000  # past the torch path's top-p candidates, with many tokens per histogram bucket


def kernel_sampler(kernels, seed: int = 0, vocab: int = VOCAB) -> Sampler:
    return Sampler(vocab_size=vocab, eos_token_ids=[EOS], device=CPU, seed=seed, kernel=kernels)


def thresholds(kernels, logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    rows = logits.shape[0]
    return kernels.truncation_thresholds(
        logits, torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.long),
        torch.full((rows,), top_p), torch.full((rows,), min_p))


def torch_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """What the sampler's torch path keeps of a one-row batch."""
    x = logits / temperature
    vocab = x.shape[1]
    lp.apply_top_k_top_p(x, torch.tensor([top_k]) if top_k < vocab else None,
                         torch.tensor([top_p]) if top_p < 1 else None, top_k if top_k < vocab else 1)
    if min_p > 0:
        lp.apply_min_p(x, torch.tensor([min_p]))
    return set(torch.isfinite(x[0]).nonzero().flatten().tolist())


CUTS = [  # (temperature, top_k or None, top_p, min_p)
    (1.0, None, 0.9, 0.0), (0.7, None, 0.95, 0.0), (0.6, 20, 0.95, 0.0), (1.0, 50, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0), (1.0, None, 0.3, 0.0), (1.3, 3000, 0.5, 0.0), (1.0, None, 1.0, 0.1),
    (1.0, 100, 0.8, 0.05), (2.0, None, 0.999, 0.0),
]


@pytest.mark.parametrize("scale", [0.01, 1.0, 4.0, 12.0])  # flat to peaked: nearly all to few near the best
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), CUTS)
def test_thresholds_keep_what_the_definition_keeps(kernels, scale, temperature, top_k, top_p, min_p):
    logits = torch.randn(1, LARGE_VOCAB, generator=torch.Generator().manual_seed(int(scale * 100) + 7)) * scale
    k = top_k or LARGE_VOCAB
    cut = thresholds(kernels, logits, temperature, k, top_p, min_p)
    scaled = logits[0] / temperature
    got = set((scaled >= cut[0]).nonzero().flatten().tolist())
    expected = reference_kept(scaled, k, top_p if top_p < 1 else 2.0)
    if min_p > 0:
        expected = {t for t in expected if scaled[t] >= scaled.max() + math.log(min_p)}
    # the float64 reference and the kernel's double sums may differ by a token on the boundary
    assert len(got ^ expected) <= 1, (len(got), len(expected))
    assert len(got ^ torch_kept(logits, temperature, k, top_p, min_p)) <= 1


def test_no_cut_keeps_every_finite_token_and_masked_ones_never(kernels):
    logits = torch.randn(3, LARGE_VOCAB, generator=torch.Generator().manual_seed(1))
    logits[:, ::7] = float("-inf")
    assert torch.equal(thresholds(kernels, logits, 1.0, LARGE_VOCAB, 1.0, 0.0), torch.full((3,), float("-inf")))
    draws = kernels.sample_rows(
        logits.repeat(200, 1), torch.ones(600), torch.full((600,), LARGE_VOCAB, dtype=torch.long), torch.ones(600),
        torch.zeros(600), torch.rand(600, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    assert all(t % 7 != 0 for t in draws.tolist())


def test_uniform_at_the_ends_picks_the_first_and_last_kept_tokens(kernels):
    logits = logits_from_probs([0.25, 0.25, 0.25, 0.25])
    logits[0, 1] = float("-inf")  # the kept tokens are 0, 2 and 3

    def draw(u: float) -> int:
        return int(kernels.sample_rows(logits, torch.ones(1), torch.full((1,), 3, dtype=torch.long), torch.ones(1),
                                       torch.zeros(1), torch.tensor([u], dtype=torch.float64))[0])

    assert draw(0.0) == 0
    assert draw(0.5) == 2
    assert draw(1.0 - 1e-12) == 3


def test_rows_of_a_batch_are_sampled_independently(kernels):
    probs = [0.5, 0.3, 0.2]
    logits = torch.cat([logits_from_probs(probs), logits_from_probs([0.0, 0.0, 1.0])]).repeat(NUM_DRAWS // 2, 1)
    out = kernel_sampler(kernels, seed=3)(logits, [row(SamplingParams(temperature=1.0)) for _ in range(NUM_DRAWS)])
    first_rows, second_rows = out.token_ids[0::2], out.token_ids[1::2]
    assert set(second_rows) == {2}
    assert chi_square([first_rows.count(t) for t in range(3)], probs) < CHI2_CRITICAL_DF2


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_matches_the_tempered_probabilities(kernels, temperature):
    probs = [0.5, 0.3, 0.2]
    logits = logits_from_probs(probs).expand(NUM_DRAWS, VOCAB).contiguous()
    out = kernel_sampler(kernels, seed=123)(logits, [row(SamplingParams(temperature=temperature))] * NUM_DRAWS)
    tempered = [p ** (1 / temperature) for p in probs]
    counts = [out.token_ids.count(t) for t in range(len(probs))]
    assert sum(counts) == NUM_DRAWS
    assert chi_square(counts, [p / sum(tempered) for p in tempered]) < CHI2_CRITICAL_DF2


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(min_p=0.5), {0, 1}),
    (SamplingParams(top_k=3, min_p=0.2, temperature=2.0), {0, 1, 2}),
])
def test_sampler_with_the_kernel_only_picks_allowed_tokens(kernels, params, allowed):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05]).expand(NUM_DRAWS, VOCAB).contiguous()
    out = kernel_sampler(kernels)(logits, [row(params) for _ in range(NUM_DRAWS)])
    assert set(out.token_ids) == allowed


def test_sampler_with_the_kernel_keeps_greedy_rows_and_seeds(kernels):
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    rows = [row(SamplingParams(temperature=0 if i % 2 == 0 else 1.5, seed=i if i == 3 else None)) for i in range(5)]
    out = kernel_sampler(kernels)(logits, rows)
    assert [out.token_ids[i] for i in (0, 2, 4)] == [int(logits[i].argmax()) for i in (0, 2, 4)]
    # the seeded row draws the same token whatever shares its batch and whatever the sampler's seed
    alone = kernel_sampler(kernels, seed=9)(logits[3:4], [row(SamplingParams(temperature=1.5, seed=3))])
    assert alone.token_ids[0] == out.token_ids[3]
    # unseeded rows follow the sampler's seed
    unseeded = [row(SamplingParams(temperature=1.5)) for _ in range(5)]
    assert kernel_sampler(kernels, seed=4)(logits, unseeded) == kernel_sampler(kernels, seed=4)(logits, unseeded)


def test_padded_vocab_columns_are_never_sampled_by_the_kernel(kernels):
    logits = torch.zeros(NUM_DRAWS, VOCAB + 8)
    logits[:, VOCAB:] = 50.0
    out = kernel_sampler(kernels)(logits, [row(SamplingParams(temperature=1.0)) for _ in range(NUM_DRAWS)])
    assert max(out.token_ids) < VOCAB


def test_bad_parameters_are_refused(kernels):
    logits = torch.zeros(1, VOCAB)
    ok = dict(temperature=torch.ones(1), top_k=torch.full((1,), VOCAB, dtype=torch.long), top_p=torch.ones(1),
              min_p=torch.zeros(1), uniform=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="temperature > 0"):
        kernels.sample_rows(logits, **{**ok, "temperature": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="one float64 uniform"):
        kernels.sample_rows(logits, **{**ok, "uniform": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match="float32"):
        kernels.sample_rows(logits.double(), **ok)


def test_the_engine_samples_through_the_kernel_on_cpu(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=64, page_size=8)
    assert llm.core.runner.sampler.kernel is not None
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=11, ignore_eos=True)
    first, again = (llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids for _ in range(2))
    assert first == again and len(set(first)) > 1  # seeded, and really sampling
