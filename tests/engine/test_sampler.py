"""The batch sampler: greedy rows, top-k / top-p / min-p truncation, the sampled distribution, and the
shapes it accepts; against small references computed by hand (processors: test_sampler_processing)."""

from __future__ import annotations

import pytest
import torch

from sampler_helpers import CHI2_CRITICAL_DF2, CPU, EOS, NUM_DRAWS, VOCAB, chi_square, logits_from_probs
from sampler_helpers import make_sampler, random_logits, reference_kept, row

from mili_openai.engine import logits_processing as lp
from mili_openai.engine.sampler import Sampler
from mili_openai.engine.sampling_params import SamplingParams

# ---- greedy ----
def test_greedy_is_argmax():
    logits = random_logits(6)
    out = make_sampler()(logits, [row(SamplingParams(temperature=0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = random_logits(5, seed=1)
    rows = [row(SamplingParams(temperature=0 if i % 2 == 0 else 1.5)) for i in range(5)]
    out = make_sampler()(logits, rows)
    for i in (0, 2, 4):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_tiny_temperature_is_greedy():
    logits = random_logits(4, seed=8) * 100
    out = make_sampler()(logits, [row(SamplingParams(temperature=1e-40)) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_only_batch_draws_no_noise():
    sampler = make_sampler()
    state = sampler.generator.get_state()
    sampler(random_logits(3), [row(SamplingParams(temperature=0)) for _ in range(3)])
    assert torch.equal(sampler.generator.get_state(), state)


# ---- truncation: top-k, top-p, min-p ----
PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize(("top_k", "top_p", "expected"), [
    (2, None, {0, 1}),
    (1, None, {0}),
    (None, 0.7, {0, 1}),  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    (None, 0.85, {0, 1, 2}),
    (None, 0.3, {0}),  # the best token alone is always kept
    (3, 0.6, {0, 1}),  # top-k first, then the nucleus of what remains
])
def test_top_k_top_p_reference(top_k, top_p, expected):
    logits = logits_from_probs(PROBS, vocab=len(PROBS))
    out = logits.clone()
    lp.apply_top_k_top_p(
        out,
        torch.tensor([top_k]) if top_k is not None else None,
        torch.tensor([top_p]) if top_p is not None else None,
        max_top_k=top_k or 1,
    )
    assert kept(out) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])  # survivors unchanged


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked: nucleus among the candidates; flat: full sort
def test_top_k_top_p_match_the_definition_on_a_large_vocab(scale):
    vocab = 4 * lp.TOP_P_CANDIDATES
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * scale
    ks = [vocab, 50, vocab, 3000, vocab, 1]
    ps = [0.9, 0.8, 1.0, 0.5, 0.3, 0.9]
    out = logits.clone()
    lp.apply_top_k_top_p(out, torch.tensor(ks), torch.tensor(ps), max_top_k=max(k for k in ks if k < vocab))
    for i in range(len(ks)):
        expected = reference_kept(logits[i], ks[i], ps[i]) if ps[i] < 1 else reference_kept(logits[i], ks[i], 2.0)
        got = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        # float32 cumulative sums may move the cut by a token on the boundary
        assert len(got ^ expected) <= 1, (i, len(got), len(expected))
    if scale < 1:
        assert len(set(torch.isfinite(out[0]).nonzero().flatten().tolist())) > lp.TOP_P_CANDIDATES


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_reference(min_p, expected):
    logits = logits_from_probs(PROBS, vocab=len(PROBS))
    lp.apply_min_p(logits, torch.tensor([min_p]))
    assert kept(logits) == expected


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(min_p=0.5), {0, 1}),
    (SamplingParams(top_k=3, min_p=0.2, temperature=2.0), {0, 1, 2}),
])
def test_sampling_only_picks_allowed_tokens(params, allowed):
    logits = logits_from_probs(PROBS).expand(NUM_DRAWS, VOCAB).contiguous()
    out = make_sampler()(logits, [row(params) for _ in range(NUM_DRAWS)])
    assert set(out.token_ids) == allowed  # every allowed token shows up, nothing else does


# ---- distribution ----
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_matches_the_distribution(temperature):
    probs = [0.5, 0.3, 0.2]
    logits = logits_from_probs(probs).expand(NUM_DRAWS, VOCAB).contiguous()
    out = make_sampler(seed=123)(logits, [row(SamplingParams(temperature=temperature)) for _ in range(NUM_DRAWS)])
    tempered = [p ** (1 / temperature) for p in probs]
    expected = [p / sum(tempered) for p in tempered]
    counts = [out.token_ids.count(t) for t in range(len(probs))]
    assert sum(counts) == NUM_DRAWS
    assert chi_square(counts, expected) < CHI2_CRITICAL_DF2


# ---- shapes, padding and skipped work ----
def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(NUM_DRAWS, VOCAB + 8)
    logits[:, VOCAB:] = 50.0  # a padded lm_head column must lose even with a huge logit
    out = Sampler(vocab_size=VOCAB, eos_token_ids=[EOS], device=CPU, seed=0)(
        logits, [row(SamplingParams(temperature=1.0)) for _ in range(NUM_DRAWS)]
    )
    assert max(out.token_ids) < VOCAB


def test_bad_shapes_are_rejected():
    sampler = make_sampler()
    with pytest.raises(ValueError):
        sampler(random_logits(2), [row()])
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, VOCAB - 1), [row()])
    assert sampler(torch.zeros(0, VOCAB), []).token_ids == []


def test_no_sort_when_no_row_truncates(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("top-k/top-p ran although no row asked for it")

    monkeypatch.setattr(lp, "apply_top_k_top_p", refuse)
    out = make_sampler()(random_logits(4), [row(SamplingParams(temperature=0.5, top_k=VOCAB)) for _ in range(4)])
    assert len(out.token_ids) == 4
    with pytest.raises(AssertionError, match="no row asked"):
        make_sampler()(random_logits(1), [row(SamplingParams(top_p=0.5))])
