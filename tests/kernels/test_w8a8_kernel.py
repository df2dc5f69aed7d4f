"""The compiled W8A8 matmul (csrc/linear_w8a8.cpp): its quantization of x bit for bit against
`quantize_int8_rows`, its integer products against an exact reference, and when the CPU path picks it
(skipped without AVX512-BF16 and VNNI)."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels
from mili_openai.kernels.quantized import (CpuQuantizedLinear, Int8Inputs, PackedWeights, int8_input_linear,
                                           quantize_int8_rows, reference_linear)

# exact integer sums scaled in float32, then one rounding to bf16: the float32 products may land a bf16 rounding
# apart from the exact value's (and groups add their float32 sums in another order)
BF16_ROUNDING = 2 ** -8
STATIC = torch.tensor([0.03125])


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels() if cpu_supports_kernels() else None
    if loaded is None or not loaded.bf16_dot_products or not loaded._module.cpu_has_int8_dot_products():
        pytest.skip("the W8A8 kernel needs AVX512-BF16 and AVX512-VNNI")
    return loaded


def random_w8a8(n: int, k: int, groups: int, static: bool, seed: int) -> PackedWeights:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)  # -128 too: the sums' offset
    return PackedWeights(8, q, torch.rand(n, groups, generator=generator) / 100,
                         int8_inputs=Int8Inputs(STATIC if static else None))


def kernel_quantize(kernels, x: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.empty(0) if static_scale is None else static_scale
    return kernels._module.quantize_int8_activations(x, scale)


def assert_quantizes_as_torch(kernels, x: torch.Tensor, static_scale: torch.Tensor | None) -> None:
    levels, scales = kernel_quantize(kernels, x, static_scale)
    want_levels, want_scales = quantize_int8_rows(x, static_scale)
    assert levels.dtype == torch.int8 and torch.equal(levels.to(torch.bfloat16), want_levels)
    assert torch.equal(scales, want_scales.expand(x.shape[0], 1).reshape(-1))


@pytest.mark.parametrize("static", [False, True])
def test_quantization_is_bit_identical_to_torchs(kernels, static):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 1024, generator=generator) * torch.rand(64, 1, generator=generator) * 8).bfloat16()
    x[3] = 0  # a row of zeros: zeros, scale 0
    x[5, :16] = 1000  # static: clamped at 127 and -128
    x[5, 16:32] = -1000
    assert_quantizes_as_torch(kernels, x, STATIC if static else None)


def test_quantization_rounds_ties_to_even_and_clamps(kernels):
    halves = torch.arange(-160, 160, dtype=torch.float32) + 0.5  # every .5 between the clamps and past them
    x = torch.cat([halves, torch.zeros(32)]).view(1, -1).bfloat16()
    assert_quantizes_as_torch(kernels, x, torch.tensor([1.0]))  # x / 1: each tie rounds to even
    levels, _ = kernel_quantize(kernels, x, torch.tensor([1.0]))
    assert int(levels.min()) == -128 and int(levels.max()) == 127 and int(levels[0, 160]) == 0  # 0.5 -> 0
    ties = torch.tensor([[127.0, 2.5, -0.5, 1.5, 0.5, -2.5] + [0.0] * 10]).bfloat16()  # amax 127: step 1
    assert_quantizes_as_torch(kernels, ties, None)
    assert kernel_quantize(kernels, ties, None)[0][0, :6].tolist() == [127, 2, 0, 2, 0, -2]


def exact_reference(x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
    """s_x * sum over groups of s_g * (q_x . q_w over the group), the dots exact in int64, the rest float64."""
    levels, x_scales = quantize_int8_rows(x, packed.int8_inputs.static_scale)
    n, k = packed.weight.shape
    groups = packed.scales.shape[1]
    q_x = levels.to(torch.int64).view(x.shape[0], 1, groups, k // groups)
    q_w = packed.weight.to(torch.int64).view(1, n, groups, k // groups)
    dots = (q_x * q_w).sum(-1)  # (M, N, G)
    return x_scales.double() * (dots.double() * packed.scales.double()).sum(-1)


def assert_one_rounding_from_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    gap = (got.double() - want).abs()
    assert bool((gap <= BF16_ROUNDING * want.abs() + 1e-30).all()), float(gap.max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k,group", [(7, 64, None), (37, 96, None), (33, 1024, None), (21, 1024, 128),
                                       (9, 256, 64), (64, 3072, None)])
@pytest.mark.parametrize("static", [False, True])
def test_kernel_matches_the_exact_integer_products(kernels, rows, n, k, group, static):
    packed = random_w8a8(n, k, k // (group or k), static, seed=rows * 100 + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = kernels._module.linear_w8a8(x, *kernels.quantized.kernel_arguments(packed))
    assert_one_rounding_from_exact(got, exact_reference(x, packed))


def test_linear_routes_decode_rows_to_the_kernel_and_prefill_to_the_gemm(kernels):
    packed = random_w8a8(40, 256, 1, False, seed=7)
    x = torch.randn(2, 3, 256).bfloat16()  # leading dims: 6 decode rows
    got = kernels.quantized.linear(x, packed)
    assert torch.equal(got.view(6, 40), kernels._module.linear_w8a8(x.view(6, 256),
                                                                    *kernels.quantized.kernel_arguments(packed)))
    many = torch.randn(kernels.max_kernel_rows + 1, 256).bfloat16()  # a prefill chunk: levels through the GEMM
    assert torch.equal(kernels.quantized.linear(many, packed), int8_input_linear(many, packed, kernels.quantized.linear))
    fp32 = torch.randn(3, 256)  # not bf16: the reference, exactly
    assert torch.equal(kernels.quantized.linear(fp32, packed), reference_linear(fp32, packed))


def test_a_cpu_without_vnni_quantizes_in_torch_and_keeps_the_weight_only_kernels(kernels):
    without = CpuQuantizedLinear(kernels._module, True, lambda: kernels.plan, int8_dot_products=False)
    packed = random_w8a8(40, 256, 1, True, seed=8)
    assert kernels.quantized.supports(packed) and not without.supports(packed)
    assert without.supports(packed._replace(int8_inputs=None))
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(without.linear(x, packed), int8_input_linear(x, packed, without.linear))
    odd_group = random_w8a8(4, 96, 3, False, seed=9)  # groups of 32: the int8 kernel's, not the W8A8 one's
    assert not kernels.quantized.supports(odd_group)
    assert torch.equal(kernels.quantized.linear(x[:, :96], odd_group),
                       int8_input_linear(x[:, :96], odd_group, kernels.quantized.linear))
