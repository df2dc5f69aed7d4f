"""A LinearAttentionKernel against the torch reference (kernels/gated_delta_rule.py), for the CPU and Triton tests.

Each check runs the kernel and the reference on the same inputs and pools (copies) and compares the outputs and
every pool row, so a kernel that writes the wrong slot, or skips one, fails.
"""

from __future__ import annotations

import torch

from mili_openai.kernels import gated_delta_rule as reference

POOL_SLOTS = 7
CONV_WIDTH = 4
TOLERANCE = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}


def delta_rule_inputs(tokens: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                      device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Raw q, k, v in `dtype`; the model's g (fp32 log-decay) and beta (sigmoid) per value head."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    decay_rate = torch.rand(v_heads, generator=generator).mul(4).exp()
    inputs = dict(q=randn(tokens, k_heads, k_dim).to(dtype), k=randn(tokens, k_heads, k_dim).to(dtype),
                  v=randn(tokens, v_heads, v_dim).to(dtype),
                  g=-decay_rate * torch.nn.functional.softplus(randn(tokens, v_heads)),
                  beta=randn(tokens, v_heads).sigmoid().to(dtype))
    return {name: x.to(device) for name, x in inputs.items()}


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(POOL_SLOTS, *shape, generator=generator) * 0.1).to(dtype).to(device)


def shuffled_slots(count: int, device: torch.device, seed: int) -> torch.Tensor:
    return torch.randperm(POOL_SLOTS, generator=torch.Generator().manual_seed(seed))[:count].to(device)


def bounds(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOLERANCE[dtype])


def check_delta_rule(kernel, lengths: list[int], heads: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype,
                     device: torch.device, seed: int = 0) -> None:
    """Prefill over `lengths` from random states, then two decode steps from the states it left."""
    k_heads, v_heads = heads
    k_dim, v_dim = dims
    total = sum(lengths)
    inputs = delta_rule_inputs(total + 2 * len(lengths), k_heads, v_heads, k_dim, v_dim, dtype, device, seed)
    pool = random_pool((v_heads, k_dim, v_dim), torch.float32, device, seed)
    slots = shuffled_slots(len(lengths), device, seed)
    pools = {"kernel": pool.clone(), "reference": pool.clone()}
    prefill = {name: x[:total] for name, x in inputs.items()}
    cu_seqlens = bounds(lengths, device)
    got = kernel.gated_delta_rule_prefill(**prefill, cu_seqlens=cu_seqlens, state_pool=pools["kernel"],
                                          state_slots=slots)
    want = reference.gated_delta_rule_prefill(**prefill, cu_seqlens=cu_seqlens, state_pool=pools["reference"],
                                              state_slots=slots)
    assert_close(got, want, dtype)
    assert_close(pools["kernel"], pools["reference"], torch.float32)
    for step in range(2):
        rows = slice(total + step * len(lengths), total + (step + 1) * len(lengths))
        decode = {name: x[rows] for name, x in inputs.items()}
        got = kernel.gated_delta_rule_decode(**decode, state_pool=pools["kernel"], state_slots=slots)
        want = reference.gated_delta_rule_decode(**decode, state_pool=pools["reference"], state_slots=slots)
        assert_close(got, want, dtype)
        assert_close(pools["kernel"], pools["reference"], torch.float32)


def check_causal_conv(kernel, lengths: list[int], channels: int, dtype: torch.dtype, device: torch.device,
                      with_bias: bool, seed: int = 0) -> None:
    """Prefill over `lengths` from random windows, then two decode steps from the windows it left."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total + 2 * len(lengths), channels, generator=generator).to(dtype).to(device)
    weight = torch.randn(channels, CONV_WIDTH, generator=generator).to(dtype).to(device)
    bias = torch.randn(channels, generator=generator).to(dtype).to(device) if with_bias else None
    pool = random_pool((channels, CONV_WIDTH - 1), dtype, device, seed)
    slots = shuffled_slots(len(lengths), device, seed)
    pools = {"kernel": pool.clone(), "reference": pool.clone()}
    cu_seqlens = bounds(lengths, device)
    got = kernel.causal_conv1d_prefill(x[:total], cu_seqlens, pools["kernel"], weight, bias, slots)
    want = reference.causal_conv1d_prefill(x[:total], cu_seqlens, pools["reference"], weight, bias, slots)
    assert_close(got, want, dtype)
    assert torch.equal(pools["kernel"], pools["reference"])
    for step in range(2):
        rows = x[total + step * len(lengths) : total + (step + 1) * len(lengths)]
        got = kernel.causal_conv1d_decode(rows, pools["kernel"], weight, bias, slots)
        want = reference.causal_conv1d_decode(rows, pools["reference"], weight, bias, slots)
        assert_close(got, want, dtype)
        assert torch.equal(pools["kernel"], pools["reference"])
