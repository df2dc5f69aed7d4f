"""The gated delta rule and its short causal conv (Gated DeltaNet layers) in plain torch, varlen over state pools.

The reference every faster implementation (compiled CPU, Triton) is tested against, and itself tested against
transformers' `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` (models/qwen3_5), which it
follows step for step. Per sequence and value head the state S is (Dk, Dv), float32; per token:
    S = exp(g) * S;  S += k (beta * (v - k^T S));  out = q^T S
with q, k L2-normalised over Dk and q scaled by Dk**-0.5 (transformers' use_qk_l2norm_in_kernel=True).
GVA: value head h reads key/query head h // (Hv // Hk).

Pools are indexed by slot: `state_pool[state_slots[i]]` is row i's (Hv, Dk, Dv) state, `conv_pool[slots[i]]` its
(C, K-1) conv window (the last K-1 inputs, oldest first; zeros for a new sequence = causal zero padding). Both are
read and written back in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of the WY form, as transformers' torch_chunk_gated_delta_rule and FLA use
L2NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon, added to the sum of squares


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as transformers' l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def normalized_query_key(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., Hk, Dk) raw q, k -> fp32 (..., Hv, Dk): L2-normalised, q scaled by Dk**-0.5, each k head repeated
    for the Hv // Hk value heads it serves."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // k.shape[-2]
    if group != 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> None:
    num_k_heads, num_v_heads = k.shape[-2], v.shape[-2]
    if q.shape != k.shape or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must match and their heads divide v's "
                         f"({num_v_heads})")
    if state_pool.dtype != torch.float32 or state_pool.shape[1:] != (num_v_heads, k.shape[-1], v.shape[-1]):
        raise ValueError(f"state_pool must be float32 (slots, {num_v_heads}, {k.shape[-1]}, {v.shape[-1]}), "
                         f"got {state_pool.dtype} {tuple(state_pool.shape)}")


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state_pool: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """One token per row: q, k (B, Hk, Dk) raw; v (B, Hv, Dv); g (B, Hv) fp32 log-decay; beta (B, Hv);
    state_pool (slots, Hv, Dk, Dv) fp32, rows `state_slots` (B,) read and updated -> out (B, Hv, Dv) in v's dtype."""
    check_heads(q, k, v, state_pool)
    q, k = normalized_query_key(q, k, v.shape[-2])  # (B, Hv, Dk)
    state = state_pool[state_slots] * g.float().exp()[..., None, None]  # (B, Hv, Dk, Dv)
    known = (state * k.unsqueeze(-1)).sum(dim=-2)  # (B, Hv, Dv): what the state already maps k to
    delta = (v.float() - known) * beta.float().unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    state_pool[state_slots] = state
    return out.to(v.dtype)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, fp32, q/k already normalised and repeated: q, k (H, T, Dk), v (H, T, Dv), g, beta (H, T),
    state (H, Dk, Dv) -> (out (H, T, Dv), final state). The chunked WY form of transformers'
    torch_chunk_gated_delta_rule: within a chunk a unit lower-triangular solve folds the delta-rule updates into
    matmuls; across chunks the state passes on."""
    length = k.shape[1]
    pad = (-length) % CHUNK_SIZE
    # zero padding at the end: beta = 0 writes nothing, g = 0 decays nothing, so the final state is unchanged
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, padded = k.shape[:2]
    chunks = padded // CHUNK_SIZE
    q, k, v = (x.view(heads, chunks, CHUNK_SIZE, x.shape[-1]) for x in (q, k, v))  # (H, N, C, D)
    beta = beta.view(heads, chunks, CHUNK_SIZE, 1)
    k_beta, v_beta = k * beta, v * beta
    cum_decay = g.view(heads, chunks, CHUNK_SIZE).cumsum(dim=-1)  # (H, N, C) log decay from the chunk start
    later = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=k.device).triu(1)
    pair_decay = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    lower = (k_beta @ k.transpose(-1, -2)) * pair_decay  # (H, N, C, C); the solve takes its strict lower part
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    k_cum_decay = torch.linalg.solve_triangular(lower, k_beta * cum_decay.exp().unsqueeze(-1), upper=False,
                                                unitriangular=True)
    q = q * cum_decay.exp().unsqueeze(-1)
    k = k * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]  # (H, N, 1, 1)
    out = torch.empty_like(v)
    for i in range(chunks):
        v_new = new_values[:, i] - k_cum_decay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.view(heads, padded, -1)[:, :length], state


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                             state_slots: torch.Tensor) -> torch.Tensor:
    """Segments of tokens: q, k (T, Hk, Dk) raw; v (T, Hv, Dv); g, beta (T, Hv); cu_seqlens (S + 1,) bounds;
    segment s starts from state_pool[state_slots[s]] and writes its final state back -> out (T, Hv, Dv) in v's
    dtype."""
    check_heads(q, k, v, state_pool)
    q, k = normalized_query_key(q, k, v.shape[-2])  # (T, Hv, Dk)
    heads_first = [x.float().transpose(0, 1) for x in (q, k, v, g, beta)]  # (Hv, T, ...)
    out = torch.empty(v.shape[1], v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for segment, slot in enumerate(state_slots.tolist()):
        start, end = bounds[segment], bounds[segment + 1]
        if start == end:
            continue
        pieces = [x[:, start:end] for x in heads_first]
        out[:, start:end], state_pool[slot] = chunked_delta_rule(*pieces, state_pool[slot])
    return out.transpose(0, 1).to(v.dtype)


def conv_step(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., C, K) inputs, oldest first, -> silu(sum_k weight[:, k] * window[..., k] + bias), (..., C) fp32."""
    out = (window.float() * weight.float()).sum(dim=-1)
    return F.silu(out if bias is None else out + bias.float())


def causal_conv1d_decode(x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         slots: torch.Tensor) -> torch.Tensor:
    """One token per row: x (B, C), conv_pool (slots, C, K-1) windows at `slots` (B,) read and shifted in place,
    weight (C, K) -> silu(depthwise causal conv) (B, C) in x's dtype."""
    window = torch.cat([conv_pool[slots], x.to(conv_pool.dtype).unsqueeze(-1)], dim=-1)  # (B, C, K)
    conv_pool[slots] = window[..., 1:]
    return conv_step(window, weight, bias).to(x.dtype)


def causal_conv1d_prefill(x: torch.Tensor, cu_seqlens: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None, slots: torch.Tensor, longest: int | None = None) -> torch.Tensor:
    """Segments of tokens: x (T, C), cu_seqlens (S + 1,); segment s continues conv_pool[slots[s]] (C, K-1) and
    leaves its last K-1 inputs there -> silu(depthwise causal conv) (T, C) in x's dtype. (`longest`: unused here,
    the Protocol's hint for kernels that size a grid by it.)"""
    channels, width = weight.shape
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for segment, slot in enumerate(slots.tolist()):
        start, end = bounds[segment], bounds[segment + 1]
        if start == end:
            continue
        inputs = torch.cat([conv_pool[slot], x[start:end].to(conv_pool.dtype).t()], dim=-1)  # (C, K-1 + L)
        conv = F.conv1d(inputs.float().unsqueeze(0), weight.float().unsqueeze(1),
                        None if bias is None else bias.float(), groups=channels)[0]  # (C, L)
        out[start:end] = F.silu(conv).t().to(x.dtype)
        conv_pool[slot] = inputs[:, inputs.shape[1] - (width - 1):]
    return out
