"""The int8/int4 matmul kernels against the torch reference on the dequantized weights: the compiled CPU
kernels (skipped without AVX512-BF16) and the Triton kernel under Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_supports_kernels, load_cpu_kernels
from mili_openai.kernels.planning import linear_via_fp32
from mili_openai.kernels.quantized import (
    GEMM_SLICE_BYTES,
    Int8Inputs,
    PackedWeights,
    dequantize,
    pack_int4,
    reference_linear,
)
from mili_openai.model.quantization.dynamic import quantize_int4, quantize_int8

RELATIVE_TOLERANCE = 1e-2  # fp32 sums, one bf16 rounding of the output: 1% of the largest output
# the same fp32 products summed in another order, then rounded to bf16: one rounding apart (of the value, or
# of a sum near zero)
FP32_GEMM_ORDER = 2 ** -7
SLICE_ROWS = 256


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels() if cpu_supports_kernels() else None
    if loaded is None or not loaded.bf16_dot_products:
        pytest.skip("the quantized kernels need AVX512-BF16")
    return loaded


def random_packed(bits: int, n: int, k: int, groups: int, zeros: bool, seed: int) -> PackedWeights:
    generator = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        return PackedWeights(8, q, torch.rand(n, groups, generator=generator) / 100)
    levels = torch.randint(0, 16, (n, k), generator=generator)
    zero_points = torch.randint(0, 17, (n, groups), generator=generator).to(torch.uint8) if zeros else None
    return PackedWeights(4, pack_int4(levels), (torch.rand(n, groups, generator=generator) / 20).half(), zero_points)


def assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, packed: PackedWeights) -> None:
    want = F.linear(x.float(), dequantize(packed, torch.float32))
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=RELATIVE_TOLERANCE,
                               atol=RELATIVE_TOLERANCE * float(want.abs().max()))


# K: one int4 block, the model's widths, and 384 (three blocks: an odd count for the two-block unroll)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(7, 128), (100, 1024), (33, 384), (64, 3072)])
@pytest.mark.parametrize("bits,group,zeros", [(8, None, False), (8, 128, False), (8, 32, False), (4, 32, True),
                                              (4, 64, True), (4, 128, True), (4, 128, False), (4, None, True)])
def test_kernels_match_the_dequantized_matmul(kernels, rows, n, k, bits, group, zeros):
    packed = random_packed(bits, n, k, k // (group or k), zeros, seed=rows * 1000 + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    kernel = kernels._module.linear_int8 if bits == 8 else kernels._module.linear_int4
    assert_close_to_reference(kernel(x, *kernels.quantized.kernel_arguments(packed)), x, packed)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantizing_kernels_give_the_references_bf16(kernels, bits):
    """The prefill path's weights: exactly what the reference rounds to bf16."""
    for group, zeros in ((None, False), (32, True), (128, False)):
        packed = random_packed(bits, 37, 256, 256 // (group or 256), zeros, seed=group or 0)
        assert torch.equal(kernels.quantized.dequantize(packed), dequantize(packed, torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 3])
def test_every_weight_row_is_written_whatever_the_threads(kernels, threads):
    packed = random_packed(4, 1000, 256, 2, True, seed=5)
    x = torch.randn(3, 256).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3):
            assert_close_to_reference(kernels.quantized.linear(x[:rows], packed), x[:rows], packed)
    finally:
        torch.set_num_threads(before)


def test_linear_routes_rows_fallbacks_and_large_heads(kernels):
    w = torch.randn(64, 256) / 16
    for packed in (quantize_int8(w), quantize_int4(w, 128)):
        x = torch.randn(2, 5, 256).bfloat16()  # leading dims
        assert_close_to_reference(kernels.quantized.linear(x, packed).view(10, 64), x.view(10, 256), packed)
        many = torch.randn(kernels.max_kernel_rows + 1, 256).bfloat16()  # a prefill chunk: dequantize + GEMM
        want = kernels.plan.large_matmul(many, dequantize(packed, torch.bfloat16))
        assert torch.equal(kernels.quantized.linear(many, packed), want)
        fp32 = torch.randn(3, 256)  # not bf16: the reference, exactly
        assert torch.equal(kernels.quantized.linear(fp32, packed), reference_linear(fp32, packed))
    head = quantize_int8(torch.randn(2 * GEMM_SLICE_BYTES // 256 + 100, 128) / 16)  # dequantized slice by slice
    many = torch.randn(kernels.max_kernel_rows + 1, 128).bfloat16()
    want = kernels.plan.large_matmul(many, dequantize(head, torch.bfloat16))
    assert torch.equal(kernels.quantized.linear(many, head), want)


# N: below one slice, one slice, slices and a partial one; rows of x: a few, a prefill chunk's, and more than
# one pass over the slices takes (4 MB of x)
@pytest.mark.parametrize("n", [7, SLICE_ROWS, 2 * SLICE_ROWS + 37])
@pytest.mark.parametrize("rows,k", [(9, 256), (300, 1024), (700, 3072)])
@pytest.mark.parametrize("bits,group,zeros", [(8, None, False), (8, 32, False), (4, 32, True), (4, 128, False)])
@pytest.mark.parametrize("widen_to_fp32", [False, True])
def test_sliced_gemm_is_the_gemm_on_the_dequantized_weight(kernels, n, rows, k, bits, group, zeros, widen_to_fp32):
    """The prefill path (weight rows dequantized a slice at a time, each slice through torch's GEMM) against that
    GEMM on the whole dequantized bf16 weight: oneDNN's bf16 GEMM gives the very same values (each output one
    sum over K either way); the fp32 GEMM may order a narrow slice's sums otherwise (FP32_GEMM_ORDER)."""
    packed = random_packed(bits, n, k, k // (group or k), zeros, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    gemm = kernels._module.gemm_int8 if bits == 8 else kernels._module.gemm_int4
    weight = dequantize(packed, torch.bfloat16)
    before = torch.get_num_threads()
    try:
        for threads in (before, 1, 3):
            torch.set_num_threads(threads)  # the GEMM's sums may split K by threads: the reference with as many
            want = (linear_via_fp32 if widen_to_fp32 else F.linear)(x, weight)
            for slice_rows, inference in ((SLICE_ROWS, False), (48, True)):  # 48: slices of 32 rows
                with torch.inference_mode(inference):  # as the engine runs it: the GEMM's threads too
                    got = gemm(x, *kernels.quantized.kernel_arguments(packed), slice_rows, widen_to_fp32)
                if widen_to_fp32:
                    torch.testing.assert_close(got.float(), want.float(), rtol=FP32_GEMM_ORDER,
                                               atol=FP32_GEMM_ORDER * float(want.abs().max()) * 2 ** -8)
                else:
                    assert torch.equal(got, want), (threads, slice_rows)
    finally:
        torch.set_num_threads(before)


def test_unsupported_layouts_keep_the_reference(kernels):
    odd_group = PackedWeights(8, torch.ones(4, 96, dtype=torch.int8), torch.ones(4, 2))  # groups of 48
    assert not kernels.quantized.supports(odd_group)
    x = torch.randn(1, 96).bfloat16()
    assert torch.equal(kernels.quantized.linear(x, odd_group), reference_linear(x, odd_group))


def _triton_linear(x: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
    """Run in the `interpreter` fixture's process: Triton picks its interpreter when it is first imported in a
    process."""
    from mili_openai.kernels.triton_quantized import triton_quantized_linear

    return triton_quantized_linear(x, packed)


def test_triton_kernel_matches_the_reference(interpreter):
    """In the interpreter, on the same bf16 weights as the reference, float32 products (triton_quantized.py)."""
    pytest.importorskip("triton")
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) / 16
    w8a8 = quantize_int8(w)._replace(int8_inputs=Int8Inputs())  # on x's int8 levels, each row scaled after
    for packed in (quantize_int8(w), quantize_int4(w, 64), quantize_int4(w, 128),
                   random_packed(4, 40, 256, 2, False, 9), w8a8):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 3, 17):
                x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
                got, want = interpreter.submit(_triton_linear, x, packed).result(), reference_linear(x, packed)
                assert got.dtype == dtype
                # bf16: the same bf16 weights and fp32 sums in another order, so at most an output rounding apart
                tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
