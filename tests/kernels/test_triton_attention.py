"""The Triton attention backend without a GPU: its kernels compile for the GPU it serves on (Hopper, sm_90), with
the compiler and ptxas Triton ships, which need no GPU: what the interpreter does not check (tl.dot's shape rules,
shared memory, types). The kernels themselves, the model and the engine through them run under Triton's CPU
interpreter in tests/kernels/test_triton_interpreted.py (cases: tests/kernels/triton_attention_cases.py and
tests/kernels/triton_compile_cases.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from mili_openai.kernels import triton_attention_kernels  # noqa: E402

HOPPER = (90, 32)  # compute capability 9.0 (H100, H200), warp size


def _ptxas_available() -> bool:
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return nvidia.exists()


def _signature(kernel, pointer_dtype: str, constexprs: dict) -> dict:
    pointers = {"q": pointer_dtype, "k_pool": pointer_dtype, "v_pool": pointer_dtype, "out": pointer_dtype,
                "page_table": "*i64", "ctx_lens": "*i64", "cu_seqlens": "*i64", "part_acc": "*fp32",
                "part_lse": "*fp32", "scale_log2": "fp32"}
    return {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}


def _launch_attributes(kernel) -> dict:
    """What a serving launch specialises on, as Triton's JIT would (the 16-byte vector loads): q, K/V and the
    outputs 16-byte aligned, their strides divisible by 16 (Qwen3's); never the kernel's runtime arguments."""
    runtime = set(kernel.do_not_specialize) if hasattr(kernel, "do_not_specialize") else set()
    aligned = {"q", "k_pool", "v_pool", "out", "part_acc", "part_lse"}
    return {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
            if name not in runtime and (name in aligned or name.startswith("stride_"))}


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton install carries no ptxas for NVIDIA targets")
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """bf16, head_dim 128 (Qwen3's): decode with and without splits, the reduce, and extend for GQA groups
    of 2 and 8, with the launch parameters TritonAttention uses (and extend's largest tuning alternative)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip(f"Triton {triton.__version__} compiles ahead of time through another interface")

    from mili_openai.kernels.triton_attention import DecodeConfig, ExtendConfig

    decode_config, extend_config = DecodeConfig(), ExtendConfig()

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the default; unset, Triton 3.9 warns that it will change
    kernels = triton_attention_kernels
    decode, reduce, extend = kernels.decode_partial_kernel, kernels.decode_reduce_kernel, kernels.extend_kernel
    shape = dict(HEAD_DIM=128, BLOCK_D=128)
    decode_n, extend_n = dict(BLOCK_N=decode_config.block_n), dict(BLOCK_N=extend_config.block_n)
    extend_order = dict(LONGEST_FIRST=extend_config.longest_first)
    variants = [
        (decode, dict(GROUP=2, BLOCK_H=16, NUM_SPLITS=1, PRECISION="tf32", WIDEN=False, **decode_n, **shape),
         decode_config),
        (decode, dict(GROUP=8, BLOCK_H=16, NUM_SPLITS=16, PRECISION="tf32", WIDEN=False, **decode_n, **shape),
         decode_config),
        (reduce, dict(NUM_SPLITS=16, HEAD_DIM=128, BLOCK_D=128, **decode_n), decode_config),
        (extend, dict(GROUP=2, GROUP_PAD=2, BLOCK_T=64, BLOCK_M=128, PRECISION="tf32", WIDEN=False, **extend_n,
                      **extend_order, **shape), extend_config),
        (extend, dict(GROUP=8, GROUP_PAD=8, BLOCK_T=16, BLOCK_M=128, PRECISION="tf32", WIDEN=False, **extend_n,
                      **extend_order, **shape), extend_config),
        # the largest tiles scripts/tune_gpu_kernels.py tries: they must fit a multiprocessor too
        (extend, dict(GROUP=2, GROUP_PAD=2, BLOCK_T=64, BLOCK_M=128, PRECISION="tf32", WIDEN=False, BLOCK_N=128,
                      LONGEST_FIRST=False, **shape), ExtendConfig(block_n=128, stages=3)),
    ]
    for kernel, constexprs, config in variants:
        source = ASTSource(kernel, _signature(kernel, "*bf16", constexprs), constexprs=constexprs,
                           attrs=_launch_attributes(kernel))
        compiled = triton.compile(source, target=GPUTarget("cuda", *HOPPER),
                                  options=dict(num_warps=config.warps, num_stages=config.stages))
        assert compiled.asm["cubin"], kernel.__name__
        assert compiled.metadata.shared <= 227 * 1024, kernel.__name__  # a Hopper block's shared memory
