"""The AVX2 bf16 matmul (kernels/cpu_avx2.py, for CPUs without AVX-512) against torch (skipped where the CPU
lacks AVX2 and FMA; every x86-64 CPU with AVX-512 has them, so it runs there too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels import cpu_avx2
from mili_openai.kernels.cpu_avx2 import Avx2BiasedLinear
from mili_openai.kernels.plan_cache import KernelPlanCache
from mili_openai.kernels.planning import KernelPlan, linear_by_rows, linear_via_fp32

pytestmark = pytest.mark.skipif(not cpu_avx2.cpu_supports_avx2_kernels(), reason="this CPU has no AVX2 and FMA")


@pytest.fixture(scope="module")
def kernels():
    built = cpu_avx2.compiled_avx2_kernels()  # built, not planned: the tests pick their own plans
    if built is None:
        pytest.skip("the AVX2 kernels did not build here (no compiler?)")
    return built


@pytest.fixture(scope="module")
def module(kernels):
    return kernels._module


def assert_matches_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fp32 accumulation then one bf16 rounding: within 1% of the magnitude
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


# rows: each tile height (4, 3, 2, 1) and chunks of them; N: whole tiles, a tail row, under one block, several
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13])
@pytest.mark.parametrize("k,n", [(16, 7), (1024, 300), (96, 130), (3072, 9), (48, 33), (64, 17)])
def test_kernel_matches_fp32_matmul(module, rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    assert_matches_fp32(module.linear_bf16_avx2(x, w), x, w)


@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("n", [1, 15, 16, 49, 1000])
def test_kernel_writes_every_output_whatever_the_threads(module, threads, n):
    """Threads take blocks of 16 weight rows (tiles of 4): every output is written once (the output starts
    uninitialised), also with more threads than blocks or cores."""
    torch.manual_seed(n)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    w = torch.randn(n, 64, dtype=torch.bfloat16) * 0.05
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 6):
            assert_matches_fp32(module.linear_bf16_avx2(x[:rows], w), x[:rows], w)
    finally:
        torch.set_num_threads(before)


# M: under, at and past one tile of 6 rows; N: under one panel of 16, a partial last panel, several blocks of 64;
# K: one 8-column step, odd multiples of 8
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(8, 7), (24, 16), (264, 17), (1024, 130), (72, 300)])
def test_gemm_matches_fp32_matmul(module, rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    assert_matches_fp32(module.gemm_bf16_avx2(x, w), x, w)


@pytest.mark.parametrize("threads", [1, 3])
def test_gemm_writes_every_output_whatever_the_threads(module, threads):
    """Threads take blocks of 64 weight rows: every output is written once (the output starts uninitialised)."""
    torch.manual_seed(threads)
    x = torch.randn(20, 48, dtype=torch.bfloat16)
    w = torch.randn(200, 48, dtype=torch.bfloat16) * 0.05
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_fp32(module.gemm_bf16_avx2(x, w), x, w)
    finally:
        torch.set_num_threads(before)


# M: under, at and past one tile of 6 rows; N: under one panel of 16, a partial last one, several blocks; K: any,
# up to a block of one panel (3072)
@pytest.mark.parametrize("rows", [1, 6, 7, 64])
@pytest.mark.parametrize("k,n", [(3, 5), (8, 16), (100, 33), (768, 70), (3072, 17)])
@pytest.mark.parametrize("activation", [None, "gelu_pytorch_tanh", "gelu"])
def test_biased_gemm_matches_fp64(kernels, rows, k, n, activation):
    """activation(x @ W.T + b) in fp32 on packed panels, the tanh GELU fused, within fp32 rounding of fp64's."""
    kernel = kernels.biased_linear
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, weight, bias = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator) * 0.05, \
        torch.randn(n, generator=generator)
    assert kernel.supports(x, weight) and not kernel.supports(x.bfloat16(), weight.bfloat16())
    want = F.linear(x.double(), weight.double(), bias.double())
    if activation is not None:
        want = F.gelu(want, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")
    got = kernel.linear(x, kernel.pack(weight, bias), activation)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    no_bias = kernel.linear(x, kernel.pack(weight, None))
    torch.testing.assert_close(no_bias.double(), F.linear(x.double(), weight.double()), rtol=1e-5, atol=1e-5)


def test_gelu_tanh_is_accurate_far_from_zero(kernels):
    """x * sigmoid(2u) for 0.5 x (1 + tanh u): no cancellation where the output is tiny (x << 0) or near x."""
    kernel = kernels.biased_linear
    x = torch.linspace(-8, 30, 153)[:, None]  # outputs down to ~1e-21, where even fp64's 1 + tanh(u) is 0
    got = kernel.linear(x, kernel.pack(torch.ones(1, 1), torch.zeros(1)), "gelu_pytorch_tanh").double()
    u = 0.7978845608028654 * (x.double() + 0.044715 * x.double() ** 3)
    torch.testing.assert_close(got, x.double() * torch.sigmoid(2 * u), rtol=1e-5, atol=0)
    torch.testing.assert_close(got, F.gelu(x.double(), approximate="tanh"), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("threads", [1, 3])
def test_biased_gemm_writes_every_output_whatever_the_threads(kernels, threads):
    kernel = kernels.biased_linear
    torch.manual_seed(threads)
    x, weight, bias = torch.randn(20, 3072), torch.randn(90, 3072) * 0.05, torch.randn(90)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.linear(x, kernel.pack(weight, bias))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_kernel_refuses_what_it_cannot_run(module):
    x = torch.randn(2, 24, dtype=torch.bfloat16)  # K not a multiple of 16
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.linear_bf16_avx2(x, torch.randn(4, 24, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        module.linear_bf16_avx2(x.float()[:, :16], torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        module.gemm_bf16_avx2(x[:, :12], torch.randn(4, 12, dtype=torch.bfloat16))
    panels, bias = module.pack_f32_panels(torch.randn(20, 24)), torch.zeros(32)
    with pytest.raises(RuntimeError, match="panels"):
        module.biased_gemm_f32_avx2(torch.randn(2, 16), panels, bias, 20, False)  # K differs
    with pytest.raises(RuntimeError, match="N within"):
        module.biased_gemm_f32_avx2(torch.randn(2, 24), panels, bias, 33, False)
    with pytest.raises(RuntimeError, match="bias padded"):
        module.biased_gemm_f32_avx2(torch.randn(2, 24), panels, torch.zeros(20), 20, False)
    with pytest.raises(ValueError, match="activation"):
        Avx2BiasedLinear(module).linear(torch.randn(2, 24), None, "relu")


def test_plan_keeps_the_sets_own_gemm_by_name(kernels, tmp_path):
    """A plan that chose this set's GEMM is written and read back by its name, as torch's GEMMs are."""
    plan = KernelPlan(max_kernel_rows=16, large_matmul=kernels.gemm)
    cache = KernelPlanCache(tmp_path, kernels.own_matmuls())
    assert cache.read_or_time({"key": "k"}, lambda: plan) == plan
    assert KernelPlanCache(tmp_path, kernels.own_matmuls()).read({"key": "k"}) == plan
    assert KernelPlanCache(tmp_path).read({"key": "k"}) is None  # a planner without the GEMM times anew


def test_linear_splits_rows_between_kernel_and_gemm(module):
    """Up to the plan's rows the kernel (any leading shape), beyond them the plan's GEMM, and non-bf16 inputs or a
    K the kernel cannot take go to F.linear."""
    calls = []

    def kernel(x, w):
        calls.append(("kernel", x.shape[0]))
        return module.linear_bf16_avx2(x, w)

    def large(x, w):
        calls.append(("large", x.numel() // x.shape[-1]))
        return linear_via_fp32(x, w)

    plan = KernelPlan(max_kernel_rows=8, large_matmul=large)
    w = torch.randn(24, 32, dtype=torch.bfloat16)
    for shape in [(2, 4, 32), (3, 32), (9, 32)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        got = linear_by_rows(x, w, kernel, plan, cpu_avx2.VECTOR_LANES)
        assert got.shape == (*shape[:-1], 24)
        assert_matches_fp32(got.reshape(-1, 24), x.reshape(-1, 32), w)
    assert calls == [("kernel", 8), ("kernel", 3), ("large", 9)]
    calls.clear()
    linear_by_rows(torch.randn(2, 32), w.float(), kernel, plan, cpu_avx2.VECTOR_LANES)  # fp32
    linear_by_rows(torch.randn(2, 12, dtype=torch.bfloat16), torch.randn(5, 12, dtype=torch.bfloat16), kernel, plan,
                   cpu_avx2.VECTOR_LANES)  # K = 12
    assert calls == []


def test_cpu_flags_decide_support(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx fma avx2 f16c bmi2\n")
    assert cpu_avx2.cpu_supports_avx2_kernels(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu sse2 avx fma avx2 bmi2\n")  # fp16 activations widen through F16C
    assert not cpu_avx2.cpu_supports_avx2_kernels(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu sse2 avx bmi2\n")
    assert not cpu_avx2.cpu_supports_avx2_kernels(cpuinfo)
    assert not cpu_avx2.cpu_supports_avx2_kernels(tmp_path / "missing")


def test_the_set_takes_a_vision_towers_projections_only_where_there_is_a_tower(kernels):
    from mili_openai.kernels.onednn_linear import OneDnnLinear
    from mili_openai.model.kernel_backend import KernelBackend

    with_tower, text_only = KernelBackend(biased_linear=OneDnnLinear()), KernelBackend()
    for backend in (with_tower, text_only):
        backend.install_avx2_kernels(kernels, torch.bfloat16)
    assert with_tower.biased_linear is kernels.biased_linear and text_only.biased_linear is None
