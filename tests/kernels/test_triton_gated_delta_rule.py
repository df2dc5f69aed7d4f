"""The Triton gated delta rule without a GPU: its kernels compile for Hopper (marked slow). The kernels themselves run
under Triton's CPU interpreter in tests/kernels/test_triton_interpreted.py (cases:
tests/kernels/triton_linear_attention_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")


def _ptxas_available() -> bool:
    triton = pytest.importorskip("triton")
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


POINTERS = {"g": "*fp32", "beta": "*fp32", "state_pool": "*fp32", "slots": "*i64", "cu_seqlens": "*i64",
            "scale": "fp32"}
HOPPER = (90, 32)  # compute capability 9.0 (H100, H200), warp size


# ~25 s of CPU (the chunked prefill kernel mostly): past this file's budget in the default run
@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="this Triton install carries no ptxas for NVIDIA targets")
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The delta-rule kernels, bf16 at Qwen3.5's shape (Dk = Dv = 128) with the launch constants the launchers use:
    what the interpreter does not check (tl.dot's shape rules, shared memory, types). The conv kernels, plain
    loads and sums, are left out: compiling costs seconds of CPU each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mili_openai.kernels import triton_gated_delta_rule as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    delta_rule = dict(DK=128, DV=128, BLOCK_K=128, BLOCK_V=kernels.BLOCK_V)
    variants = [(kernels.delta_rule_decode_kernel, delta_rule),
                (kernels.delta_rule_prefill_kernel, dict(CHUNK=kernels.CHUNK_SIZE, PRECISION="tf32", **delta_rule))]
    for kernel, constexprs in variants:
        signature = {name: "constexpr" if name in constexprs else POINTERS.get(name, "i32" if name.startswith(
            ("stride", "num", "group")) else "*bf16") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", *HOPPER), options=dict(num_warps=4, num_stages=2))
        assert compiled.asm["cubin"], kernel.__name__
        assert compiled.metadata.shared <= 227 * 1024, kernel.__name__  # a Hopper block's shared memory
