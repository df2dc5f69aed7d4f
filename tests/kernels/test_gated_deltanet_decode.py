"""The fused Gated DeltaNet decode step (csrc/gated_deltanet_layer.h) against the layer's ops one by one, in each
kernel set this CPU runs (AVX-512, AVX2: the `kernel_set` fixture).

One layer, its weights drawn at random, runs the same steps twice on copies of the same pools: with the torch
reference ops (TorchLinearAttention: the layer's `_mix`, op by op) and with the CPU kernels, whose decode rows
take the fused step. Outputs and every pool row must agree, so a step that writes the wrong slot, skips the
conv window or rounds at another point fails.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from linear_attention_helpers import TOLERANCE, shuffled_slots
from mili_openai.kernels.linear_attention import TorchLinearAttention
from mili_openai.model.config import ModelConfig
from mili_openai.model.gated_deltanet import GatedDeltaNet, StateRows
from mili_openai.model.kernel_backend import KernelBackend

POOL_SLOTS = 7
STEPS = 3
# the fp32 state after a few bf16 steps: the rounding points agree, the fp32 sums' order does not
STATE_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
                   torch.float16: dict(rtol=5e-3, atol=5e-3)}
# (key heads, value heads, Dk, Dv): the tiny checkpoint's GVA shape, and Dk no whole register with Dv two of them
SHAPES = [None, (1, 2, 24, 32)]


@pytest.fixture(scope="module")
def base_config(hybrid_checkpoint) -> ModelConfig:
    return ModelConfig.from_pretrained(hybrid_checkpoint("qwen3_5"))


def random_layer(base: ModelConfig, shape: tuple[int, int, int, int] | None, dtype: torch.dtype,
                 seed: int = 0) -> GatedDeltaNet:
    config = base
    if shape is not None:
        k_heads, v_heads, k_dim, v_dim = shape
        linear = dataclasses.replace(base.hybrid.linear, num_key_heads=k_heads, num_value_heads=v_heads,
                                     key_head_dim=k_dim, value_head_dim=v_dim)
        config = dataclasses.replace(base, hybrid=dataclasses.replace(base.hybrid, linear=linear))
    layer = GatedDeltaNet(config, KernelBackend())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            drawn = torch.randn(parameter.shape, generator=generator)
            if name == "A_log":  # decay rates from 1 to 16, as the random checkpoints draw them
                drawn = torch.rand(parameter.shape, generator=generator).mul(math.log(16)).exp().log()
            elif name == "norm.weight":
                drawn = 1 + 0.1 * drawn
            elif parameter.dim() == 2:
                drawn = drawn / math.sqrt(parameter.shape[-1])
            parameter.copy_(drawn)
    return layer.to(dtype)


def random_pools(layer: GatedDeltaNet, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    conv = torch.randn(POOL_SLOTS, layer.conv_dim, layer.conv1d.weight.shape[1] - 1, generator=generator)
    state = 0.1 * torch.randn(POOL_SLOTS, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=generator)
    return conv.to(dtype), state


def decode_rows(slots: torch.Tensor, groups: list[int] | None = None) -> StateRows:
    """Decode rows only (`groups`: rows per sequence where some verify drafts, each sequence on one slot)."""
    if groups is None:
        return StateRows(slots, slots[:0], torch.zeros(1, dtype=torch.int64), slots.numel())
    starts = [sum(groups[:i]) for i in range(len(groups))]
    steps = []
    for depth in range(max(groups)):
        rows = torch.tensor([s + depth for s, count in zip(starts, groups) if count > depth], dtype=torch.int64)
        steps.append((rows, slots[rows]))
    return StateRows(slots, slots[:0], torch.zeros(1, dtype=torch.int64), slots.numel(), steps)


def run_both(layer: GatedDeltaNet, kernel_set, dtype: torch.dtype, steps: list[tuple[torch.Tensor, StateRows]],
             kept_rows: int = 0) -> None:
    """Each (x, rows) step through the reference ops and through the kernels, from the same pools; compared."""
    pools = random_pools(layer, dtype, seed=1)
    runs = {}
    for name, kernel in (("reference", TorchLinearAttention()), ("kernels", kernel_set.linear_attention)):
        layer.backend.linear_attention = kernel  # the layer's own backend: only this test holds it
        conv_pool, state_pool = (pool.clone() for pool in pools)
        kept = (conv_pool.new_zeros(kept_rows, *conv_pool.shape[1:]),
                state_pool.new_zeros(kept_rows, *state_pool.shape[1:])) if kept_rows else None
        with torch.inference_mode():
            outputs = [layer(x, rows, conv_pool, state_pool, kept) for x, rows in steps]
        runs[name] = (outputs, conv_pool, state_pool, kept)
    (want, want_conv, want_state, want_kept), (got, got_conv, got_state, got_kept) = runs["reference"], runs["kernels"]
    for step, (out, expected) in enumerate(zip(got, want)):
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype], msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(got_conv, want_conv, rtol=0, atol=0)  # the window holds inputs: exact
    torch.testing.assert_close(got_state, want_state, **STATE_TOLERANCE[dtype])
    if kept_rows:
        torch.testing.assert_close(got_kept[0], want_kept[0], rtol=0, atol=0)
        torch.testing.assert_close(got_kept[1], want_kept[1], **STATE_TOLERANCE[dtype])


def hidden_rows(layer: GatedDeltaNet, rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, layer.in_proj.weight.shape[1], generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_decode_matches_the_ops(kernel_set, base_config, shape, dtype):
    layer = random_layer(base_config, shape, dtype)
    slots = shuffled_slots(3, torch.device("cpu"), seed=2)
    steps = [(hidden_rows(layer, 3, dtype, seed), decode_rows(slots)) for seed in range(STEPS)]
    run_both(layer, kernel_set, dtype, steps)


def test_fused_decode_runs_for_the_model_shapes(kernel_set, base_config):
    """The kernels take the fused step (not the ops) for a bf16 layer: it returns out_proj's input."""
    layer = random_layer(base_config, None, torch.bfloat16)
    conv_pool, state_pool = random_pools(layer, torch.bfloat16, seed=3)
    projected = layer.in_proj(hidden_rows(layer, 2, torch.bfloat16, seed=4))
    weights = layer.decode_weights()
    out = kernel_set.linear_attention.deltanet_decode(projected, weights, conv_pool, state_pool, torch.tensor([5, 0]))
    assert out is not None and out.shape == (2, layer.value_dim) and out.dtype == torch.bfloat16


def test_verifying_rows_keep_each_rows_state(kernel_set, base_config):
    """Two sequences verifying drafts (3 rows and 1 row): each depth continues the slot its row before left, and
    the state each row leaves is kept, as the runner rolls rejected drafts back from it."""
    dtype = torch.bfloat16
    layer = random_layer(base_config, None, dtype)
    slots = torch.tensor([4, 4, 4, 1])
    run_both(layer, kernel_set, dtype, [(hidden_rows(layer, 4, dtype, seed=5), decode_rows(slots, [3, 1]))],
             kept_rows=4)


def test_decode_rows_beside_prefill_chunks(kernel_set, base_config):
    """Decode rows take the fused step, the prefill chunks of the same step the prefill ops."""
    dtype = torch.bfloat16
    layer = random_layer(base_config, None, dtype)
    rows = StateRows(torch.tensor([6, 2]), torch.tensor([0, 3]), torch.tensor([0, 5, 12]), 2)
    run_both(layer, kernel_set, dtype, [(hidden_rows(layer, 14, dtype, seed=6), rows)])


def test_a_norm_weight_in_another_dtype_runs_the_ops(kernel_set, base_config):
    """A float32 gated-norm weight beside bf16 activations rounds differently: no fused step, the ops run."""
    layer = random_layer(base_config, None, torch.bfloat16)
    layer.norm.weight.data = layer.norm.weight.data.float()
    conv_pool, state_pool = random_pools(layer, torch.bfloat16, seed=7)
    projected = layer.in_proj(hidden_rows(layer, 1, torch.bfloat16, seed=8))
    assert kernel_set.linear_attention.deltanet_decode(projected, layer.decode_weights(), conv_pool, state_pool,
                                                    torch.tensor([0])) is None


def test_out_of_range_slot_is_refused(kernel_set, base_config):
    layer = random_layer(base_config, None, torch.float32)
    conv_pool, state_pool = random_pools(layer, torch.float32, seed=9)
    projected = layer.in_proj(hidden_rows(layer, 1, torch.float32, seed=10))
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel_set.linear_attention.deltanet_decode(projected, layer.decode_weights(), conv_pool, state_pool,
                                                 torch.tensor([POOL_SLOTS]))
