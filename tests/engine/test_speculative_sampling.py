"""Speculative decoding at temperature > 0 keeps the target's distribution: a chi-square test over many seeded
draws of the real sampler on a 6-token vocabulary, with temperature, top-k, top-p, min-p and penalties.

A decode verifying draft d samples its row 0 (the token after its last one) and its row 1 (the token after d,
sampled as if d were accepted: its penalties see d), and keeps d only if row 0's sample is d
(engine/speculation.py's `accepted_counts`, the rule `EngineCore.postprocess` applies). That is Leviathan et
al.'s rejection sampling for a draft that is one token for sure: the first token out is row 0's sample, drawn
from the target; the second, after d, is row 1's, drawn from the target given d. The expected distributions are
computed here independently of the sampler, from the formulas."""

from __future__ import annotations

import torch

from mili_openai.engine.sampler import Sampler, SamplingRow
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.speculation import SpeculationPlan, accepted_counts

VOCAB = 6
PROMPT = [5]
DRAFT = 1
PAIRS = 20000
# the 0.999 quantile of the chi-square distribution by degrees of freedom: a correct sampler fails 1 in 1,000
# seeds, and this test's seed is fixed
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.97, min_p=0.03, presence_penalty=0.6,
                        repetition_penalty=1.3, seed=None, max_tokens=8)
LOGITS_ROW0 = torch.tensor([0.3, 1.1, 0.9, -0.4, -2.5, 0.2])
LOGITS_ROW1 = torch.tensor([1.2, 0.8, -0.3, 0.5, -1.9, -3.0])


def expected_distribution(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's distribution of the next token after `history`, from the definitions: repetition penalty
    over prompt and output, presence penalty over the output, temperature, top-k, top-p (the smallest set of
    likeliest tokens whose mass reaches p), min-p (below min_p times the likeliest token's probability)."""
    x = logits.clone().double()
    for token in {*PROMPT, *history}:
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(history):
        x[token] -= params.presence_penalty
    probs = (x / params.temperature).softmax(-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    order = probs.argsort(descending=True)
    keep[order[: params.top_k]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]  # mass of the likelier tokens
    nucleus = torch.zeros(VOCAB, dtype=torch.bool)
    nucleus[order[before < params.top_p]] = True
    probs = torch.where(nucleus, probs, 0.0)
    probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(the statistic, degrees of freedom) of observed counts against a distribution; tokens of probability
    0 must never be drawn."""
    total = int(counts.sum())
    support = expected > 0
    assert int(counts[~support].sum()) == 0, f"drew tokens outside the distribution's support: {counts}"
    expected_counts = expected[support] * total
    statistic = float(((counts[support].double() - expected_counts) ** 2 / expected_counts).sum())
    return statistic, int(support.sum()) - 1


def test_rejection_sampling_keeps_the_target_distribution():
    sampler = Sampler(VOCAB, eos_token_ids=[], device=torch.device("cpu"), seed=1234)
    rows = []
    for _ in range(PAIRS):  # each verify: row 0 with the output so far, row 1 with the draft appended
        rows.append(SamplingRow(PARAMS, None, PROMPT, []))
        rows.append(SamplingRow(PARAMS, None, PROMPT, [DRAFT]))
    logits = torch.stack([LOGITS_ROW0, LOGITS_ROW1]).repeat(PAIRS, 1).float()
    tokens = sampler(logits, rows).token_ids
    plan = SpeculationPlan(group_rows=list(range(0, 2 * PAIRS, 2)), group_drafts=[[DRAFT]] * PAIRS, group_slots=None)
    accepted = accepted_counts(plan, tokens)
    first = torch.tensor(tokens[0::2])
    second = torch.tensor([tokens[2 * i + 1] for i in range(PAIRS) if accepted[i]])
    assert all(kept == (token == DRAFT) for kept, token in zip(accepted, first.tolist()))

    p_first = expected_distribution(LOGITS_ROW0, [], PARAMS)
    p_second = expected_distribution(LOGITS_ROW1, [DRAFT], PARAMS)
    assert 0.2 < p_first[DRAFT] < 0.6  # drafts are both kept and rejected often
    assert (p_first == 0).any() and (p_second == 0).any()  # the truncations bite
    for observed, expected in ((first, p_first), (second, p_second)):
        statistic, dof = chi_square(torch.bincount(observed, minlength=VOCAB), expected)
        assert statistic < CHI2_999[dof], (statistic, dof, expected)


def test_the_penalised_distribution_differs_so_the_test_can_fail():
    """Row 1 without the draft in its history has another distribution, which the chi-square test rejects: the
    test above tells a sampler that ignores the draft's penalties from a correct one."""
    sampler = Sampler(VOCAB, eos_token_ids=[], device=torch.device("cpu"), seed=99)
    rows = [SamplingRow(PARAMS, None, PROMPT, []) for _ in range(PAIRS)]  # the draft left out
    tokens = torch.tensor(sampler(LOGITS_ROW1.repeat(PAIRS, 1), rows).token_ids)
    statistic, dof = chi_square(torch.bincount(tokens, minlength=VOCAB),
                                expected_distribution(LOGITS_ROW1, [DRAFT], PARAMS))
    assert statistic > CHI2_999[dof]
