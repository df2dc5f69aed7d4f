"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, and the chosen SwiGLU experts' outputs
are summed with the router's weights.

Math as transformers' `Qwen3MoeSparseMoeBlock`: router logits in the activations' dtype, softmax over the
experts in float32, top-k, optionally renormalised (`norm_topk_prob`), weights cast back.

Experts are stacked per layer at load: `gate_up_proj` (E, 2I, H), gate rows first, and `down_proj` (E, H, I).
The (token, expert) pairs are sorted by expert, so each expert runs one matmul over all its tokens: a
Python loop over the experts that have tokens, never over tokens. On CUDA an `ExpertsKernel` (the Triton
fused-MoE kernel) runs them all in two launches instead; on CPU with bf16 weights a compiled kernel runs the
router and the experts in one call (kernels/csrc/moe_block.cpp), reading each routed expert once per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.model.kernel_backend import KernelBackend, MatmulFn, require_backend
from mili_openai.model.layers import Linear, SwiGLUMLP


class Router(nn.Module):
    """The (E, H) gate. Its matmul is always torch's: with tensor parallelism every rank routes the same
    replicated activations itself, and must pick the same experts, so no rank-local kernel choice may enter.
    (The CPU `SparseMoeKernel` routes with its own matmul, whose result depends neither on a plan nor on the
    threads: every rank picks alike there too.)"""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (weights (T, k) in x's dtype, expert ids (T, k) int64)."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # (T, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


def grouped_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, matmul: MatmulFn,
                   activation) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]) -> (T, H), one matmul pair per expert.

    Each expert's rows are a contiguous segment after a stable sort by expert id; the weighted rows go back
    to (token, slot) order and each token's k rows are summed (in float32, rounded once). Not a row-wise
    index_add_: on CPU its parallel kernel stalls for orders of magnitude longer than this gather and sum.
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)  # (T*k,)
    order = torch.argsort(flat, stable=True)  # (T*k,) pairs grouped by expert, token order within each
    token_of = order // top_k  # (T*k,) the token of each sorted pair
    rows = x.index_select(0, token_of)  # (T*k, H)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    pieces = []
    start = 0
    for expert, count in enumerate(counts):
        if count:
            segment = rows[start : start + count]  # (n, H)
            pieces.append(matmul(activation(matmul(segment, gate_up[expert])), down[expert]))  # (n, H)
            start += count
    out = torch.cat(pieces).mul_(topk_weights.reshape(-1)[order, None])  # (T*k, H) by expert
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    return out.index_select(0, unsort).view(-1, top_k, x.shape[1]).sum(dim=1)  # (T, H)


class GroupedExperts(nn.Module):
    """E SwiGLU experts in two stacked weights, run through the backend's `experts` kernel where it has one
    (CUDA), else by `grouped_swiglu` with its `matmul` and `fused_ops` (SwiGLU's activation)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 backend: KernelBackend) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.backend = require_backend(backend)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        experts = self.backend.experts
        if experts is not None:
            return experts.fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        return grouped_swiglu(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.backend.matmul,
                              self._activation)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(n, 2I) gate first -> silu(gate) * up, (n, I)."""
        kernel = self.backend.fused_ops
        if kernel is not None and kernel.supports_silu_mul(gate_up):
            return kernel.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate).mul_(up)

    def extra_repr(self) -> str:
        experts, hidden, intermediate = self.down_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={intermediate}"


class SparseMoeBlock(nn.Module):
    """Router + experts, with a running count of the (token, expert) pairs each expert received (the layer's
    expert load, for debugging through `LLM.expert_load()`). The backend's `sparse_moe` kernel (CPU, bf16) runs
    the whole block in one call where it takes the shapes."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 normalize: bool, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = require_backend(backend)
        self.gate = Router(hidden_size, num_experts, top_k, normalize)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, self.backend)
        # on CPU even when the model is built on the meta device; not in checkpoints; moves with .to()
        with torch.device("cpu"):
            self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        experts, kernel = self.experts, self.backend.sparse_moe
        if kernel is not None and kernel.supports_sparse_moe(x, experts.gate_up_proj):
            return kernel.sparse_moe(x, self.gate.weight, experts.gate_up_proj, experts.down_proj,
                                          self.gate.top_k, self.gate.normalize, self.expert_load)
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)
        self.expert_load.index_add_(0, flat, torch.ones_like(flat))  # no host sync: a CUDA graph replays it
        return self.experts(x, ids, weights)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3.5-MoE / Qwen3-Next's sparse block: the routed experts plus a shared SwiGLU expert every token goes
    through, scaled by sigmoid(shared_expert_gate(x)) (transformers' Qwen3NextSparseMoeBlock)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, normalize: bool,
                 shared_intermediate_size: int, backend: KernelBackend) -> None:
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, normalize, backend)
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, self.backend)
        self.shared_expert_gate = Linear(hidden_size, 1, self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        shared = self.shared_expert(x).mul_(torch.sigmoid(self.shared_expert_gate(x)))
        return super().forward(x).add_(shared)
