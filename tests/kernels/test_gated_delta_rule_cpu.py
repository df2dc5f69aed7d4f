"""The compiled CPU gated delta rule and causal conv (csrc/gated_delta_rule_ops.h) against the torch reference, in
each kernel set this CPU runs (AVX-512, AVX2: the `kernel_set` fixture)."""

from __future__ import annotations

import pytest
import torch

from linear_attention_helpers import check_causal_conv, check_delta_rule, delta_rule_inputs
from mili_openai.kernels.gated_delta_rule import gated_delta_rule_prefill
from mili_openai.kernels.linear_attention import LinearAttentionKernel

CPU = torch.device("cpu")
SEGMENTS = [1, 5, 64, 65, 130]
# (key heads, value heads), (Dk, Dv): GVA; Dv 80 takes a 64-column block and a 16-column one
SHAPES = [((2, 4), (24, 80)), ((1, 1), (32, 16))]


def test_cpu_kernels_are_a_linear_attention_kernel(kernel_set):
    assert isinstance(kernel_set.linear_attention, LinearAttentionKernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dims", SHAPES)
def test_delta_rule_matches_reference(kernel_set, heads, dims, dtype):
    check_delta_rule(kernel_set.linear_attention, SEGMENTS, heads, dims, dtype, CPU)


def test_delta_rule_takes_strided_rows_and_an_empty_segment(kernel_set):
    """q, k, v as the model splits them from one projection (rows apart), and a zero-length segment."""
    inputs = delta_rule_inputs(6, 2, 4, 16, 32, torch.float32, CPU, seed=1)
    fused = torch.cat([inputs["q"].flatten(1), inputs["k"].flatten(1), inputs["v"].flatten(1)], dim=1)
    q, k, v = (part.view(6, -1, size) for part, size in zip(fused.split([32, 32, 128], dim=1), (16, 16, 32)))
    assert not q.is_contiguous()
    cu_seqlens, slots = torch.tensor([0, 2, 2, 6]), torch.tensor([3, 1, 0])
    pools = [torch.randn(4, 4, 16, 32) for _ in range(2)]
    pools[1].copy_(pools[0])
    got = kernel_set.linear_attention.gated_delta_rule_prefill(q, k, v, inputs["g"], inputs["beta"], cu_seqlens,
                                                            pools[0], slots)
    want = gated_delta_rule_prefill(**inputs, cu_seqlens=cu_seqlens, state_pool=pools[1], state_slots=slots)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pools[0], pools[1], rtol=2e-5, atol=2e-5)


def test_shapes_outside_the_kernel_fall_back_to_torch(kernel_set):
    """Dv = 8 is no whole register: the torch reference runs, with the same results."""
    check_delta_rule(kernel_set.linear_attention, [3, 2], (1, 2), (8, 8), torch.float32, CPU)


def test_out_of_range_slot_is_refused(kernel_set):
    inputs = delta_rule_inputs(1, 1, 1, 16, 16, torch.float32, CPU, seed=2)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel_set.linear_attention.gated_delta_rule_decode(**inputs, state_pool=torch.zeros(2, 1, 16, 16),
                                                         state_slots=torch.tensor([2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv_matches_reference(kernel_set, dtype, with_bias):
    # 304 channels: a whole 256-channel task and a part one
    check_causal_conv(kernel_set.linear_attention, [1, 2, 5, 64], 304, dtype, CPU, with_bias)


def test_conv_channels_outside_the_kernel_fall_back_to_torch(kernel_set):
    """300 channels are no whole registers: the torch reference runs, with the same results."""
    check_causal_conv(kernel_set.linear_attention, [1, 6], 300, torch.float32, CPU, with_bias=True)
