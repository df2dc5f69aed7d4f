"""The torch gated delta rule and causal conv (kernels/gated_delta_rule.py) against transformers' own functions.

fp32, tiny shapes, GVA (2 key heads over 4 value heads), segments of odd lengths around the 64-token chunk,
starting from random states in shuffled pool slots; prefill then decode from the stored state equals one run.
"""

from __future__ import annotations

import pytest
import torch

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from mili_openai.kernels.gated_delta_rule import (  # noqa: E402
    causal_conv1d_decode,
    causal_conv1d_prefill,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
)
from mili_openai.kernels.linear_attention import LinearAttentionKernel, TorchLinearAttention  # noqa: E402

SEGMENTS = [1, 5, 64, 65, 130]
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8
SLOTS = 8
DECODE_STEPS = 3
CHANNELS, CONV_WIDTH = 24, 4
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def delta_rule_inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return dict(q=randn(tokens, K_HEADS, K_DIM), k=randn(tokens, K_HEADS, K_DIM), v=randn(tokens, V_HEADS, V_DIM),
                # the model's decay: -exp(A_log) * softplus(a + dt_bias), some near 0, some steep
                g=-torch.rand(V_HEADS, generator=generator).mul(4).exp() * torch.nn.functional.softplus(
                    randn(tokens, V_HEADS)),
                beta=randn(tokens, V_HEADS).sigmoid())


def pooled_states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of random states and one shuffled slot per segment."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(SLOTS, V_HEADS, K_DIM, V_DIM, generator=generator) * 0.1
    slots = torch.randperm(SLOTS, generator=generator)[: len(SEGMENTS)]
    return pool, slots


def oracle(function, inputs: dict[str, torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (1, T, H, D) function on one sequence -> (out (T, Hv, Dv), final state (Hv, Dk, Dv))."""
    out, final = function(*(inputs[name].unsqueeze(0) for name in ("q", "k", "v", "g", "beta")),
                          initial_state=state.unsqueeze(0).clone(), output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.fixture(scope="module")
def segments():
    """The prefill's inputs over all segments, each segment's slice, and each segment's continuation tokens."""
    total = sum(SEGMENTS)
    inputs = delta_rule_inputs(total + DECODE_STEPS * len(SEGMENTS), seed=0)
    prefill = {name: x[:total] for name, x in inputs.items()}
    decode = {name: x[total:].view(DECODE_STEPS, len(SEGMENTS), *x.shape[1:]) for name, x in inputs.items()}
    bounds = torch.tensor([0, *SEGMENTS]).cumsum(0)
    return prefill, decode, bounds


def segment_inputs(inputs, bounds, index):
    return {name: x[bounds[index] : bounds[index + 1]] for name, x in inputs.items()}


def test_prefill_matches_chunked_oracle_per_segment(segments):
    prefill, _, bounds = segments
    pool, slots = pooled_states(seed=1)
    initial = pool.clone()
    out = gated_delta_rule_prefill(**prefill, cu_seqlens=bounds, state_pool=pool, state_slots=slots)
    for index, slot in enumerate(slots.tolist()):
        want_out, want_state = oracle(qwen3_5.torch_chunk_gated_delta_rule, segment_inputs(prefill, bounds, index),
                                      initial[slot])
        torch.testing.assert_close(out[bounds[index] : bounds[index + 1]], want_out, **TOLERANCE)
        torch.testing.assert_close(pool[slot], want_state, **TOLERANCE)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], initial[untouched])


def test_prefill_then_decode_equals_one_recurrent_run(segments):
    prefill, decode, bounds = segments
    pool, slots = pooled_states(seed=2)
    initial = pool.clone()
    gated_delta_rule_prefill(**prefill, cu_seqlens=bounds, state_pool=pool, state_slots=slots)
    steps = [gated_delta_rule_decode(**{name: x[step] for name, x in decode.items()}, state_pool=pool,
                                     state_slots=slots) for step in range(DECODE_STEPS)]
    decoded = torch.stack(steps, dim=1)  # (S, steps, Hv, Dv)
    for index, slot in enumerate(slots.tolist()):
        whole = {name: torch.cat([segment_inputs(prefill, bounds, index)[name], decode[name][:, index]])
                 for name in prefill}
        want_out, want_state = oracle(qwen3_5.torch_recurrent_gated_delta_rule, whole, initial[slot])
        torch.testing.assert_close(decoded[index], want_out[-DECODE_STEPS:], **TOLERANCE)
        torch.testing.assert_close(pool[slot], want_state, **TOLERANCE)


def test_decode_keeps_v_dtype_and_state_fp32():
    inputs = {name: x if name == "g" else x.to(torch.bfloat16) for name, x in delta_rule_inputs(2, seed=3).items()}
    pool = torch.zeros(SLOTS, V_HEADS, K_DIM, V_DIM)
    out = gated_delta_rule_decode(**inputs, state_pool=pool, state_slots=torch.tensor([5, 2]))
    assert out.dtype == torch.bfloat16 and out.shape == (2, V_HEADS, V_DIM)
    assert pool[[5, 2]].abs().sum() > 0 and pool[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


def test_rejects_mismatched_heads_and_state_dtype():
    inputs = delta_rule_inputs(1, seed=4)
    with pytest.raises(ValueError, match="state_pool"):
        gated_delta_rule_decode(**inputs, state_pool=torch.zeros(SLOTS, V_HEADS, K_DIM, V_DIM, dtype=torch.bfloat16),
                                state_slots=torch.tensor([0]))
    inputs["k"] = torch.randn(1, 3, K_DIM)
    with pytest.raises(ValueError, match="heads"):
        gated_delta_rule_decode(**inputs, state_pool=torch.zeros(SLOTS, V_HEADS, K_DIM, V_DIM),
                                state_slots=torch.tensor([0]))


@pytest.fixture(scope="module")
def conv_case():
    generator = torch.Generator().manual_seed(5)
    total = sum(SEGMENTS)
    x = torch.randn(total + DECODE_STEPS * len(SEGMENTS), CHANNELS, generator=generator)
    weight = torch.randn(CHANNELS, CONV_WIDTH, generator=generator)
    bias = torch.randn(CHANNELS, generator=generator)
    return x[:total], x[total:].view(DECODE_STEPS, len(SEGMENTS), CHANNELS), weight, bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_prefill_then_decode_equals_one_causal_conv(conv_case, with_bias):
    """Zero windows (new sequences): transformers' causal_conv1d_fn over each whole sequence, prefill then decode;
    and its causal_conv1d_update for the decode steps from the window prefill left."""
    prefill, decode, weight, bias = conv_case
    bias = bias if with_bias else None
    bounds = torch.tensor([0, *SEGMENTS]).cumsum(0)
    pool = torch.zeros(SLOTS, CHANNELS, CONV_WIDTH - 1)
    slots = torch.tensor([6, 0, 3, 7, 1])
    out = causal_conv1d_prefill(prefill, bounds, pool, weight, bias, slots)
    windows = pool[slots].clone()
    steps = torch.stack([causal_conv1d_decode(decode[step], pool, weight, bias, slots) for step in range(DECODE_STEPS)],
                        dim=1)  # (S, steps, C)
    for index in range(len(SEGMENTS)):
        whole = torch.cat([prefill[bounds[index] : bounds[index + 1]], decode[:, index]])  # (L, C)
        want = qwen3_5.causal_conv1d_fn(whole.t().unsqueeze(0), weight, bias, activation="silu")[0].t()
        torch.testing.assert_close(out[bounds[index] : bounds[index + 1]], want[: SEGMENTS[index]], **TOLERANCE)
        torch.testing.assert_close(steps[index], want[SEGMENTS[index] :], **TOLERANCE)
        torch.testing.assert_close(pool[slots[index]], whole[-(CONV_WIDTH - 1) :].t(), **TOLERANCE)
    state = windows.clone()
    want_steps = [qwen3_5.causal_conv1d_update(decode[step].unsqueeze(-1), state, weight, bias, "silu")[..., 0]
                  for step in range(DECODE_STEPS)]
    torch.testing.assert_close(steps, torch.stack(want_steps, dim=1), **TOLERANCE)


def test_conv_prefill_continues_a_window():
    """A later prefill chunk of a sequence continues from the window its earlier chunk left."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(9, CHANNELS, generator=generator)
    weight = torch.randn(CHANNELS, CONV_WIDTH, generator=generator)
    pool = torch.zeros(2, CHANNELS, CONV_WIDTH - 1)
    slot = torch.tensor([1])
    first = causal_conv1d_prefill(x[:2], torch.tensor([0, 2]), pool, weight, None, slot)
    second = causal_conv1d_prefill(x[2:], torch.tensor([0, 7]), pool, weight, None, slot)
    whole = causal_conv1d_prefill(x, torch.tensor([0, 9]), torch.zeros_like(pool), weight, None, slot)
    torch.testing.assert_close(torch.cat([first, second]), whole, **TOLERANCE)


def test_torch_reference_is_a_linear_attention_kernel():
    assert isinstance(TorchLinearAttention(), LinearAttentionKernel)
