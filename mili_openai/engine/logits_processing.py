"""Vectorised logits processors: pure tensor functions over a (B, V) batch, one parameter per row.

Each function takes per-row parameters as tensors (or flat index lists) and works on the whole batch at
once; the sampler decides which rows need which processor and skips the ones no row asks for. Rows that
do not use top-k / top-p carry its neutral value (top_k = V, top_p = 1), so a batch mixing users and
non-users is still one tensor op; logit_bias, min_tokens and the penalties take flat (row, token)
entries and touch only those.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")
# Tokens sorted for top-p before falling back to a full sort (see apply_top_k_top_p).
TOP_P_CANDIDATES = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) -> (B,) int64: each row's first maximum, or its first NaN; `torch.argmax`'s answer.

    On CPU in float32 through numpy, whose argmax has the same rule for ties and NaN: torch's CPU argmax
    is a scalar reduction, many times slower over Qwen3's vocabulary, and a greedy step waits for it on
    the forward thread while the second core idles.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype("int64", copy=False))
    return x.argmax(dim=-1)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small list as a tensor on `device`. To a GPU from pinned memory: an asynchronous copy, where a
    pageable one would make the host wait for the work already queued (a step launched ahead would then
    wait for the running one)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def apply_additive_bias(
    logits: torch.Tensor, row_indices: Sequence[int], token_ids: Sequence[int], biases: Sequence[float]
) -> None:
    """logits[row, token] += bias for each (row, token, bias) triple, in place (OpenAI `logit_bias`).

    Token ids must already be validated against V; a duplicate (row, token) pair accumulates.
    """
    device = logits.device
    rows = to_device(row_indices, torch.long, device)
    tokens = to_device(token_ids, torch.long, device)
    values = to_device(biases, logits.dtype, device)
    logits.index_put_((rows, tokens), values, accumulate=True)


def mask_tokens(logits: torch.Tensor, row_indices: Sequence[int], token_ids: Sequence[int]) -> None:
    """logits[row, token] = -inf for each (row, token) pair, in place (`min_tokens` blocks EOS/stop ids)."""
    device = logits.device
    rows = to_device(row_indices, torch.long, device)
    tokens = to_device(token_ids, torch.long, device)
    logits.index_put_((rows, tokens), torch.full((), NEG_INF, dtype=logits.dtype, device=device))


def apply_repetition_penalty(
    logits: torch.Tensor, row_indices: Sequence[int], token_ids: Sequence[int], penalties: Sequence[float]
) -> None:
    """HF/vLLM repetition penalty on the tokens seen in a row's prompt or output, in place.

    A seen token's positive logit is divided by the penalty and a negative one multiplied, so a penalty
    above 1 always makes it less likely. One (row, token, penalty) triple per distinct seen token:
    only those entries are read and written, not the row's whole vocabulary.
    """
    device = logits.device
    rows = to_device(row_indices, torch.long, device)
    tokens = to_device(token_ids, torch.long, device)
    penalty = to_device(penalties, logits.dtype, device)
    values = logits[rows, tokens]
    logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, row_indices: Sequence[int], token_ids: Sequence[int], counts: Sequence[int],
    presence: Sequence[float], frequency: Sequence[float],
) -> None:
    """OpenAI semantics, in place: logit -= presence + frequency * count for each token of a row's output.

    One (row, token, count, presence, frequency) entry per distinct output token; tokens that never
    appeared are left as they are (their penalty is 0).
    """
    device = logits.device
    rows = to_device(row_indices, torch.long, device)
    tokens = to_device(token_ids, torch.long, device)

    def column(values: Sequence[float]) -> torch.Tensor:
        return to_device(values, logits.dtype, device)

    logits[rows, tokens] = logits[rows, tokens] - column(presence) - column(frequency) * column(counts)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> None:
    """Mask everything outside each row's top-k and its top-p nucleus to -inf, in place.

    top_k: (R,) long, V where off; max_top_k: the largest k of the rows that use it (a Python int, so
    no host sync); top_p: (R,) float in (0, 1], 1 where off. Top-k is applied first, then top-p keeps
    the smallest set of the remaining tokens whose probability reaches p (the best token always
    survives). Each row is cut at a threshold logit, so tokens tied with the last kept one stay too.

    A full sort of (R, V) costs more than the forward on CPU, so only the best `TOP_P_CANDIDATES`
    (or max_top_k) tokens are sorted; the nucleus almost always lies among them. When it does not for
    some row (a flat distribution) the rows are sorted in full: the one host sync of this path.
    """
    vocab = logits.shape[1]
    if top_p is None:
        candidates = min(max_top_k, vocab)
    else:
        candidates = min(max(max_top_k, TOP_P_CANDIDATES), vocab)
    threshold, covered = _truncation_threshold(logits, top_k, top_p, candidates)
    if covered is not None and not bool(covered.all()):
        threshold, _ = _truncation_threshold(logits, top_k, top_p, vocab)
    logits.masked_fill_(logits < threshold, NEG_INF)


def _truncation_threshold(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, candidates: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row lowest logit to keep, (R, 1), from the best `candidates` tokens of each row.

    Also returns, when top-p is asked for, a (R,) bool: whether that choice is exact for the row (its
    top-p nucleus lies among the candidates); None otherwise.
    """
    vocab = logits.shape[1]
    if candidates < vocab:
        values = logits.topk(candidates, dim=-1).values  # (R, C), best first
    else:
        values = logits.sort(dim=-1, descending=True).values  # (R, V)
    num_rows = logits.shape[0]
    if top_k is None:
        top_k = torch.full((num_rows,), vocab, dtype=torch.long, device=logits.device)
    k_on = top_k <= candidates  # (R,) rows whose whole top-k set is among the candidates
    k = top_k.clamp(max=candidates).unsqueeze(1)  # (R, 1)
    threshold = torch.where(k_on.unsqueeze(1), values.gather(1, k - 1), NEG_INF)  # (R, 1)
    if top_p is None:
        return threshold, None

    position = torch.arange(candidates, device=logits.device)  # (C,)
    values = values.masked_fill(position >= k, NEG_INF)  # (R, C) top-k applied
    # Normalise over what top-k left: the candidates themselves, or the whole row when top-k is off.
    log_total = torch.where(k_on, values.logsumexp(dim=-1), logits.logsumexp(dim=-1)).unsqueeze(1)  # (R, 1)
    probs = (values - log_total).exp()  # (R, C)
    cumulative = probs.cumsum(dim=-1)  # (R, C)
    mass_before = cumulative - probs  # probability of the strictly better candidates
    p = top_p.unsqueeze(1)  # (R, 1)
    # Keep a candidate while the better ones alone stay below p; never past k (float slack near 1).
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp(min=1).minimum(k)  # (R, 1)
    p_threshold = values.gather(1, num_kept - 1)  # (R, 1)
    p_on = p < 1
    threshold = torch.where(p_on, torch.maximum(threshold, p_threshold), threshold)
    covered = ~p_on.squeeze(1) | k_on | (cumulative[:, -1] >= top_p)  # (R,)
    return threshold, covered


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's best probability, in place.

    Done in logit space (p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)), so no softmax is
    needed. logits: (R, V); min_p: (R,) in [0, 1] (0 = off, log(0) = -inf keeps everything).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # (R, 1)
    logits.masked_fill_(logits < threshold, NEG_INF)
