"""The Triton RMSNorm, q/k norm + RoPE and SwiGLU activation (kernels/triton_fused_ops.py), run by Triton's
interpreter on CPU tensors against the torch forms they replace on CUDA; and compiled for Hopper without
a GPU. Triton decides between compiling and interpreting when it is imported, so the kernels run in a
process started with TRITON_INTERPRET=1, and only there."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mili_openai.model.config import ModelConfig
from mili_openai.model.layers import rms_normalize
from mili_openai.model.rope import apply_rotary

triton = pytest.importorskip("triton")

# compiled here (the interpreter fixture's variable must not be set when Triton decorates them)
from mili_openai.kernels import triton_fused_ops as ops  # noqa: E402

EPS = 1e-6
HOPPER = (90, 32)  # compute capability 9.0 (H100, H200), warp size
# float32: the sums run in another order than torch's; bf16: that order may move a value across a rounding
# boundary, one unit in the last place of bf16's 8 bits at most
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def _call(op: str, *args):
    from mili_openai.kernels.triton_fused_ops import TritonFusedOps

    kernel = TritonFusedOps()
    assert kernel.device_type == "cpu", "the interpreter did not take over"
    assert getattr(kernel, f"supports_{op}")(args[0])
    return getattr(kernel, op)(*args)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_close_and_mostly_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])
    if expected.dtype == torch.bfloat16:  # the roundings are torch's: nearly every value is bit-identical
        assert (actual == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96])  # a power of two, and one the block masks
def test_rms_norm_matches_the_torch_form(interpreter, dtype, width):
    x = randn(7, width, dtype=dtype, seed=1, scale=3.0)
    weight = randn(width, dtype=dtype, seed=2) + 1
    actual = interpreter.submit(_call, "rms_norm", x, weight, EPS).result()
    assert_close_and_mostly_equal(actual, weight * rms_normalize(x, EPS))


def _add_rms_norm(x, residual, weight, eps):
    """The kernel's (h, normed), and x after the call: h is written over it."""
    h, normed = _call_pair("add_rms_norm", x, residual, weight, eps)
    return h, normed, x


def _call_pair(op: str, *args):
    from mili_openai.kernels.triton_fused_ops import TritonFusedOps

    kernel = TritonFusedOps()
    assert kernel.device_type == "cpu", "the interpreter did not take over"
    assert getattr(kernel, f"supports_{op}")(args[0], args[1])
    return getattr(kernel, op)(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96])  # a power of two, and one the block masks
def test_add_rms_norm_matches_the_torch_form(interpreter, dtype, width):
    x = randn(2, 3, width, dtype=dtype, seed=7, scale=3.0)
    residual = randn(2, 3, width, dtype=dtype, seed=8, scale=3.0)
    weight = randn(width, dtype=dtype, seed=9) + 1
    expected_h = x.clone().add_(residual)  # what the layers' torch form does to a projection's fresh output
    # a copy: torch hands tensors to the worker process in shared memory, where the kernel writes h over x
    h, normed, x_after = interpreter.submit(_add_rms_norm, x.clone(), residual, weight, EPS).result()
    assert torch.equal(h, expected_h) and torch.equal(x_after, expected_h)  # one rounding of one sum: exact
    assert_close_and_mostly_equal(normed, weight * rms_normalize(expected_h, EPS))


def _model_hidden(checkpoint, residual_kernel: bool) -> tuple[torch.Tensor, int]:
    """The tiny model's final hidden states over a two-sequence prefill, with the Triton residual add + norm
    wired in or not; and how many times the kernel ran."""
    from model_helpers import PagedSequences, random_tokens

    from mili_openai.kernels.triton_fused_ops import TritonFusedOps
    from mili_openai.model import KVCache, ModelCaches, load_model

    class Counting(TritonFusedOps):
        calls = 0

        def add_rms_norm(self, *args):
            Counting.calls += 1
            return super().add_rms_norm(*args)

    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    if residual_kernel:
        model.backend.residual_norm = Counting()
    pages = PagedSequences(num_pages=16, page_size=4)
    pages.add("a", random_tokens(9, seed=1))
    pages.add("b", random_tokens(5, seed=2))
    batch, _ = pages.batch([], [("a", 9), ("b", 5)])
    with torch.inference_mode():
        hidden = model(batch, ModelCaches(KVCache(model.cache_specs(), 16, 4, torch.float32, torch.device("cpu"))))
    return hidden, Counting.calls


def test_the_model_runs_each_residual_add_and_norm_as_one_kernel(interpreter, tiny_checkpoint):
    """Every add-then-norm of the layers and the final norm goes through the kernel, and the model's
    output is the torch form's."""
    expected, _ = interpreter.submit(_model_hidden, tiny_checkpoint, False).result()
    actual, calls = interpreter.submit(_model_hidden, tiny_checkpoint, True).result()
    num_layers = ModelConfig.from_pretrained(tiny_checkpoint).num_hidden_layers
    assert calls == 2 * num_layers  # each layer's post-attention norm, the next input norm or the final one
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("tokens", [5, 37])  # one program's rows, and several with the last one partial
def test_qk_norm_rope_matches_the_torch_form_on_a_strided_view(interpreter, dtype, head_dim, tokens):
    heads, kv_heads = 4, 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3, scale=2.0)
    # as the attention layer passes it: q and k rows of the fused projection, v's left out
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    q_weight, k_weight = randn(head_dim, dtype=dtype, seed=4) + 1, randn(head_dim, dtype=dtype, seed=5) + 1
    angles = torch.arange(tokens)[:, None, None] * torch.linspace(0.1, 1.0, head_dim // 2)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)
    actual = interpreter.submit(_call, "qk_norm_rope", qk, q_weight, k_weight, heads, EPS, cos, signed_sin).result()
    norm_weight = torch.cat((q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)))
    expected = apply_rotary(rms_normalize(qk, EPS) * norm_weight, cos, signed_sin)
    assert_close_and_mostly_equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1500])  # one block, and two with the second masked
def test_silu_mul_matches_the_torch_form(interpreter, dtype, width):
    gate_up = randn(3, 2, 2 * width, dtype=dtype, seed=6, scale=4.0)
    actual = interpreter.submit(_call, "silu_mul", gate_up).result()
    gate, up = gate_up.split(width, dim=-1)
    assert_close_and_mostly_equal(actual, F.silu(gate).mul_(up))


def _ptxas_available() -> bool:
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton install carries no ptxas for NVIDIA targets")
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """bf16 at Qwen3-0.6B's widths (hidden 1024, head_dim 128, intermediate 3072), as the launchers call them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip(f"Triton {triton.__version__} compiles ahead of time through another interface")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    pointers = {"x_ptr", "r_ptr", "w_ptr", "out_ptr", "qk_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                "gate_up_ptr"}
    variants = [(ops._rms_norm_kernel, dict(BLOCK=1024, ROUND_BF16=True)),
                (ops._add_rms_norm_kernel, dict(BLOCK=1024, ROUND_BF16=True)),
                (ops._qk_norm_rope_kernel, dict(HEADS=24, NUM_Q_HEADS=16, HEAD_DIM=128,
                                                BLOCK_ROWS=ops.FusedOpsConfig().qk_rope_elements // 128,
                                                ROUND_BF16=True)),
                (ops._silu_mul_kernel, dict(BLOCK=ops.FusedOpsConfig().silu_block, ROUND_BF16=True))]
    for kernel, constexprs in variants:
        signature = {name: "constexpr" if name in constexprs else "*bf16" if name in pointers
                     else "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", *HOPPER), options=dict(num_warps=4))
        assert compiled.asm["cubin"], kernel.__name__


class _TorchForms:
    """The fused ops' contract in torch: what a working kernel gives."""

    def rms_norm(self, x, weight, eps):
        return weight * rms_normalize(x, eps)

    def qk_norm_rope(self, qk, q_weight, k_weight, num_q_heads, eps, cos, signed_sin):
        return apply_rotary(rms_normalize(qk, eps), cos, signed_sin)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


    def add_rms_norm(self, x, residual, weight, eps):
        hidden = x.add_(residual)
        return hidden, self.rms_norm(hidden, weight, eps)


class _Unbuildable(_TorchForms):
    def qk_norm_rope(self, *args):
        raise RuntimeError("PassManager::run failed")  # what a Triton too old for a kernel raises

    def add_rms_norm(self, *args):
        raise RuntimeError("PassManager::run failed")


def test_the_fused_ops_are_kept_only_where_they_build(tiny_checkpoint, caplog):
    from mili_openai.model.backend_setup import _fused_ops_compile, _residual_norm_compiles
    from mili_openai.model.loader import load_model

    model, _ = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    assert _fused_ops_compile(_TorchForms(), model)
    assert _residual_norm_compiles(_TorchForms(), model)
    assert not _fused_ops_compile(_Unbuildable(), model)
    assert "PassManager::run failed" in caplog.text and "run as torch ops" in caplog.text
    caplog.clear()
    assert not _residual_norm_compiles(_Unbuildable(), model)
    assert "residual add + RMSNorm" in caplog.text and "runs as torch ops" in caplog.text
