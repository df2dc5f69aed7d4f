"""The vision tower's projections on oneDNN (kernels/onednn_linear.py): activation(x @ W.T + b) on a weight packed
once, against F.linear, the bias and F.gelu; and the tower's `biased_linear` packing a weight on first use and
again once the weight or the kernel is another."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili_openai.kernels.onednn_linear import GELU_ALGORITHMS, OneDnnLinear, onednn_linear
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.qwen3_5_vision import biased_linear

pytestmark = pytest.mark.skipif(onednn_linear() is None, reason="torch was built without oneDNN")

ROWS, IN, OUT = 40, 64, 48
FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 2e-2


def reference(x, weight, bias, activation):
    out = F.linear(x.double(), weight.double(), bias.double())
    return out if activation is None else F.gelu(out, approximate=GELU_ALGORITHMS[activation])


@pytest.mark.parametrize("activation", [None, *GELU_ALGORITHMS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_with_the_bias_and_gelu_fused(activation, dtype):
    kernel = OneDnnLinear()
    if dtype not in kernel.dtypes:
        pytest.skip("oneDNN does not run bf16 natively on this CPU")
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((ROWS, IN), (OUT, IN), (OUT,)))
    assert kernel.supports(x, weight) and not kernel.supports(x.double(), weight.double())
    got = kernel.linear(x, kernel.pack(weight, bias), activation)
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(got.double(), reference(x, weight, bias, activation), atol=tolerance,
                               rtol=tolerance)


def test_biased_linear_packs_once_per_weight_tensor():
    backend, packs = KernelBackend(biased_linear=OneDnnLinear()), {}
    x, weight, bias = torch.randn(ROWS, IN), torch.randn(OUT, IN), torch.randn(OUT)
    biased_linear(backend, x, weight, bias, packs)
    first = packs["packed"]
    biased_linear(backend, x, weight, bias, packs)
    assert packs["packed"] is first
    other = weight * 2
    torch.testing.assert_close(biased_linear(backend, x, other, bias, packs), F.linear(x, other, bias))
    assert packs["packed"] is not first
    second = packs["packed"]
    # another kernel in the backend: packed again, in its own layout
    backend.biased_linear = OneDnnLinear()
    torch.testing.assert_close(biased_linear(backend, x, other, bias, packs), F.linear(x, other, bias))
    assert packs["kernel"] is backend.biased_linear and packs["packed"].source == second.source
    assert packs["packed"] is not second
    # without the kernel: matmul, bias, then the activation, as before
    torch.testing.assert_close(biased_linear(KernelBackend(), x, weight, bias, {}, "gelu_pytorch_tanh"),
                               F.gelu(F.linear(x, weight, bias), approximate="tanh"))


def test_no_kernel_without_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn_linear() is None
