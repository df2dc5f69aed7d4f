"""Quantization numbers and schemes: round trips within each scheme's bound, the int4 layout, reading
config.json's quantization_config (and refusing what is not supported), and the flags."""

from __future__ import annotations

import pytest
import torch

from mili_openai.cli import build_parser, config_from_args
from mili_openai.config import EngineConfig
from mili_openai.kernels.fp8 import (
    WEIGHT_ONLY_MAX_ROWS,
    Fp8Weights,
    dequantize_fp8,
    per_row_weights,
    quantize_rows_fp8,
    uses_weight_only,
)
from mili_openai.kernels.quantized import PackedWeights, dequantize, pack_int4, reference_linear, unpack_int4
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.quantization.dynamic import FP8_MAX, quantize_fp8, quantize_int4, quantize_int8
from mili_openai.model.quantization.modules import Fp8Linear, QuantizedLinear
from mili_openai.model.quantization.spec import (
    CheckpointQuantization,
    check_quantization,
    parse_quantization_config,
)

FP8_RELATIVE_STEP = 2 ** -3  # e4m3 keeps 3 mantissa bits: neighbours are 1/8 apart relative to the value


def weights(rows: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) / 16
    w[3] = 0  # a row of zeros
    w[5, :128] = w[5, :128].abs() + 0.01  # a group with no negative value: its range still holds 0
    w[7] *= 1000  # a far larger row
    return w


def test_int8_round_trip_is_within_half_a_step():
    w = weights()
    packed = quantize_int8(w)
    assert packed.weight.dtype == torch.int8 and packed.scales.shape == (48, 1)
    assert int(packed.weight.abs().max()) <= 127
    error = (dequantize(packed, torch.float32) - w).abs()
    assert bool((error <= packed.scales / 2 * (1 + 1e-6)).all())
    assert bool((dequantize(packed, torch.float32)[3] == 0).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_its_step(group):
    w = weights()
    packed = quantize_int4(w, group)
    assert packed.weight.shape == (48, 128) and packed.scales.dtype == torch.float16
    assert packed.scales.shape == packed.zeros.shape == (48, 256 // group)
    scale = packed.scales.float().repeat_interleave(group, dim=1)
    error = (dequantize(packed, torch.float32) - w).abs()
    # half a step inside the group's range; at most a step where a range end was clamped to the levels
    assert bool((error <= scale * (1 + 1e-3)).all())
    assert float((error <= scale / 2 * (1 + 1e-3)).float().mean()) > 0.99
    assert bool((dequantize(packed, torch.float32)[3] == 0).all())


def test_int4_layout_packs_four_lanes_a_word():
    levels = torch.randint(0, 16, (3, 256), generator=torch.Generator().manual_seed(1))
    packed = pack_int4(levels)
    assert packed.shape == (3, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), levels.to(torch.uint8))
    word = int(packed[0, 0]) | int(packed[0, 1]) << 8  # word 0 of block 0: values 0, 32, 64, 96
    assert [word >> (4 * i) & 0xF for i in range(4)] == [int(levels[0, 32 * i]) for i in range(4)]
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_int4(levels[:, :64])


def test_fp8_round_trip_is_within_e4m3s_step():
    w = weights()
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    back = q.float() * scale[:, None]
    smallest_normal = 2.0 ** -6 * scale[:, None]
    assert bool(((back - w).abs() <= torch.maximum(w.abs() * FP8_RELATIVE_STEP / 2, smallest_normal)).all())


def test_fp8_linear_takes_the_weight_only_path_for_decode_batches():
    """Up to WEIGHT_ONLY_MAX_ROWS rows (and for float32 x, or block scales, at any size): the matmul on the
    dequantized weights, x unquantized; the reference the Triton weight-only kernel is held to."""
    w = weights()
    layer = Fp8Linear(per_row_weights(*quantize_fp8(w)), KernelBackend())
    dequantized = dequantize_fp8(layer.fp8)
    for x in (torch.randn(5, 256), torch.randn(WEIGHT_ONLY_MAX_ROWS + 3, 256)):  # float32: always weight-only
        torch.testing.assert_close(layer(x), x @ dequantized.T)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), (x.float() @ dequantized.T).bfloat16())


def test_fp8_linear_quantizes_activations_per_token_for_prefill_chunks():
    """Past WEIGHT_ONLY_MAX_ROWS rows of bf16 x with row scales: x quantized per row to e4m3, times the e4m3
    weights, both scales in float32 (the emulation of torch._scaled_mm, which the CUDA test holds it to)."""
    w, x = weights(), torch.randn(WEIGHT_ONLY_MAX_ROWS + 1, 256).bfloat16()
    layer = Fp8Linear(per_row_weights(*quantize_fp8(w)), KernelBackend())
    q, x_scale = quantize_rows_fp8(x)
    assert float((q.float() * x_scale).abs().max()) <= float(x.float().abs().max()) * (1 + FP8_RELATIVE_STEP)
    want = ((q.float() * x_scale) @ dequantize_fp8(layer.fp8).T).bfloat16()
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    exact = x.float() @ w.T  # against the unquantized product: within what e4m3 on both sides allows
    assert float((layer(x).float() - exact).abs().max()) < 4 * FP8_RELATIVE_STEP * float(exact.abs().max())


def test_fp8_path_switch_is_by_rows_dtype_and_scales():
    rows = per_row_weights(*quantize_fp8(weights()))
    blocks = Fp8Weights(rows.weight, torch.ones(1, 2), (128, 128))
    assert uses_weight_only(WEIGHT_ONLY_MAX_ROWS, torch.bfloat16, rows)
    assert not uses_weight_only(WEIGHT_ONLY_MAX_ROWS + 1, torch.bfloat16, rows)
    assert not uses_weight_only(WEIGHT_ONLY_MAX_ROWS + 1, torch.float16, rows)
    assert uses_weight_only(WEIGHT_ONLY_MAX_ROWS + 1, torch.float32, rows)
    assert uses_weight_only(WEIGHT_ONLY_MAX_ROWS + 1, torch.bfloat16, blocks)


def test_fp8_block_scales_dequantize_per_block():
    q = torch.randn(200, 300).to(torch.float8_e4m3fn)
    scales = torch.arange(1, 7, dtype=torch.float32).view(2, 3)
    got = dequantize_fp8(Fp8Weights(q, scales, (128, 128)))
    assert torch.equal(got[127, 255], q[127, 255].float() * 2) and torch.equal(got[128, 256], q[128, 256].float() * 6)
    assert torch.equal(got[199, 0], q[199, 0].float() * 4)


def test_quantized_linear_reference_is_the_dequantized_matmul():
    w, x = weights(), torch.randn(2, 3, 256)
    for packed in (quantize_int8(w), quantize_int4(w, 128)):
        layer = QuantizedLinear(packed, KernelBackend())
        assert layer(x).shape == (2, 3, 48)
        torch.testing.assert_close(layer(x), x @ dequantize(packed, torch.float32).T)
        assert torch.equal(layer(x.bfloat16()), reference_linear(x.bfloat16(), packed))
    with pytest.raises(ValueError, match="8- or 4-bit"):
        QuantizedLinear(PackedWeights(16, w), KernelBackend())


@pytest.mark.parametrize("raw,want", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     CheckpointQuantization("fp8", 8, block=(128, 128))),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
     CheckpointQuantization("awq", 4, group_size=128)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
     CheckpointQuantization("gptq", 4, group_size=128, zero_offset=1)),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "checkpoint_format": "gptq_v2"},
     CheckpointQuantization("gptq", 8, group_size=None, zero_offset=0)),
])
def test_supported_checkpoint_configs(raw, want):
    assert parse_quantization_config(raw) == want
    assert parse_quantization_config(None) is None


@pytest.mark.parametrize("raw,message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemm"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero points"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "not supported; supported"),
])
def test_unsupported_checkpoint_configs_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


def test_flag_and_checkpoint_combinations():
    awq = CheckpointQuantization("awq", 4, group_size=128)
    check_quantization(None, awq, "cpu")
    check_quantization("int4", None, "cpu")
    check_quantization("fp8", None, "cuda")
    with pytest.raises(ValueError, match="already quantized"):
        check_quantization("int8", awq, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        check_quantization("fp8", None, "cpu")


def test_cli_flags_reach_the_engine_config():
    parser = build_parser()
    config = config_from_args(parser.parse_args(["serve", "--quantization", "int4",
                                                 "--quantization-group-size", "64"]))
    assert (config.engine.quantization, config.engine.quantization_group_size) == ("int4", 64)
    assert config.engine.quantize_lm_head is None
    config = config_from_args(parser.parse_args(["serve", "--quantization", "int4", "--quantize-lm-head", "int4"]))
    assert config.engine.quantize_lm_head == "int4"
    with pytest.raises(ValueError, match="quantize_lm_head applies"):
        EngineConfig(quantize_lm_head="int4")
    with pytest.raises(ValueError, match="quantize_lm_head must be"):
        EngineConfig(quantization="int4", quantize_lm_head="int2")
    assert config_from_args(parser.parse_args(["serve"])).engine.quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int3"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="nf4")
    with pytest.raises(ValueError, match="group_size"):
        EngineConfig(quantization="int4", quantization_group_size=96)
