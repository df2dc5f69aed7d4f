"""The compiled CPU MoE kernels (kernels/csrc/moe_experts.cpp, moe_block.cpp) against the router and grouped
torch path (model/moe.py) they replace for bf16 weights on CPU (skipped where the CPU cannot run the kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.moe import Router, SparseMoeBlock, grouped_swiglu

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")


def routed(tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, seed: int):
    """bf16 activations and experts, and a softmax router's top-k choice for each token."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5)
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    router = Router(hidden, num_experts, top_k, normalize=True)
    router.weight.data = torch.randn(num_experts, hidden, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        weights, ids = router(x)
    return x, gate_up.to(torch.bfloat16), down.to(torch.bfloat16), ids, weights


def rounded_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 x @ weight.T accumulated in fp32 and rounded once, as the kernel's matmuls."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def swiglu(gate_up_rows: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_rows.chunk(2, dim=-1)
    return F.silu(gate) * up  # transformers' rounding: silu rounded, then the product


def reference(x, gate_up, down, ids, weights) -> torch.Tensor:
    return grouped_swiglu(x, gate_up, down, ids, weights, rounded_matmul, swiglu)


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fp32 sums in another order may land a value on the other side of a bf16 rounding boundary, rarely
    assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max()))


def product_kinds(kernels) -> list[bool]:
    return [False, True] if kernels.bf16_dot_products else [False]


# one decode row; a decode batch; a prefill chunk with more rows per expert than one pass (64) takes, which
# multiplies packed panels (expert_tiles.h); widths that leave partial units (intermediate 48: a 16-column
# gate unit; hidden 96: a 32-row down unit), streamed and in panels (K = 48: pairs beyond the last whole
# 16 x 16 block); more experts than tokens route to (experts without pairs)
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,intermediate", [
    (1, 8, 2, 64, 32), (16, 32, 4, 128, 64), (300, 4, 2, 64, 32), (9, 6, 3, 96, 48), (200, 3, 2, 96, 48),
    (3, 64, 2, 32, 16),
])
def test_fused_experts_match_the_grouped_torch_path(kernels, tokens, num_experts, top_k, hidden, intermediate):
    x, gate_up, down, ids, weights = routed(tokens, num_experts, top_k, hidden, intermediate, seed=tokens)
    want = reference(x, gate_up, down, ids, weights)
    for pairs in product_kinds(kernels):
        got = kernels._module.moe_experts_bf16(x, gate_up, down, ids, weights, pairs)
        assert_matches_reference(got, want)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_experts_cover_every_pair_whatever_the_threads(kernels, threads):
    """Threads own ranges of units and take from each other's backs: every output row is written once (the
    buffers start uninitialised), also with more threads than cores, and all tokens on one expert."""
    x, gate_up, down, _, weights = routed(20, 4, 2, 64, 32, seed=5)
    ids = torch.tensor([[1, 3]] * 20)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels._module.moe_experts_bf16(x, gate_up, down, ids, weights, kernels.bf16_dot_products)
    finally:
        torch.set_num_threads(before)
    assert_matches_reference(got, reference(x, gate_up, down, ids, weights))


def test_fused_experts_refuse_bad_routing(kernels):
    x, gate_up, down, ids, weights = routed(2, 4, 2, 32, 16, seed=1)
    experts = kernels._module.moe_experts_bf16
    with pytest.raises(RuntimeError, match="outside"):
        experts(x, gate_up, down, torch.tensor([[0, 4], [1, 2]]), weights, False)
    with pytest.raises(RuntimeError, match="int64"):
        experts(x, gate_up, down, ids.int(), weights, False)


def rounded_routing(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool):
    """model/moe.py's Router with the logits' matmul accumulated in fp32 and rounded once, as the kernel's."""
    probs = torch.softmax(rounded_matmul(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 8, 2), (16, 128, 8), (150, 16, 4)])
def test_sparse_moe_routes_and_runs_the_experts(kernels, normalize, tokens, num_experts, top_k):
    """The router's choice (softmax in fp32, top-k, renormalised or not) and the experts in one call; the
    expert load gains every routed pair."""
    x, gate_up, down, _, _ = routed(tokens, num_experts, top_k, 64, 32, seed=tokens + num_experts)
    router = (torch.randn(num_experts, 64, generator=torch.Generator().manual_seed(tokens)) / 8).to(torch.bfloat16)
    weights, ids = rounded_routing(x, router, top_k, normalize)
    load = torch.zeros(num_experts, dtype=torch.int64)
    got = kernels.sparse_moe(x, router, gate_up, down, top_k, normalize, load)
    assert_matches_reference(got, reference(x, gate_up, down, ids, weights))
    assert torch.equal(load, torch.bincount(ids.reshape(-1), minlength=num_experts))


def test_sparse_block_takes_the_kernel_where_it_fits(kernels):
    """A bf16 block with whole-vector widths runs the kernel and counts its load there; an intermediate size
    that is not (a tensor-parallel slice of a small model) and fp32 keep the torch path."""
    block = SparseMoeBlock(hidden_size=64, num_experts=8, top_k=2, intermediate_size=32, normalize=True,
                           backend=KernelBackend())
    x, gate_up, down, _, _ = routed(5, 8, 2, 64, 32, seed=3)
    block.gate.weight.data = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    block.experts.gate_up_proj.data, block.experts.down_proj.data = gate_up, down
    block.backend.sparse_moe = kernels
    assert kernels.supports_sparse_moe(x, gate_up)
    weights, ids = rounded_routing(x, block.gate.weight, 2, True)
    with torch.inference_mode():
        assert_matches_reference(block(x), reference(x, gate_up, down, ids, weights))
    assert int(block.expert_load.sum()) == 5 * 2
    assert not kernels.supports_sparse_moe(x, torch.empty(8, 2 * 8, 64, dtype=torch.bfloat16))
    assert not kernels.supports_sparse_moe(x.float(), gate_up.float())
