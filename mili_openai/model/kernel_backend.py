"""The kernel backend: one object per loaded model that every module calls for its compute-heavy ops.

A module never picks a kernel. It holds the model's `KernelBackend`, a required argument of its constructor
(`require_backend`: a module built without one fails there rather than run torch's ops unseen), and calls
`backend.matmul`, `backend.attention`, `backend.fused_ops`, ... where one is set, else torch's form, which is
always correct. The modules that take it: the decoder layers' projections, norms, attention and MLPs (Qwen3's and
the hybrids'), Gated DeltaNet (`linear_attention`), the MoE blocks, the quantized projections, the MTP predictor
(the target's backend), the LoRA wrappers (`lora`) and the vision tower's projections and attention. The loader
fills the backend once for the device (model/backend_setup.py):
- **torch** (`KernelBackend()`): torch's matmuls, SDPA over gathered K/V, the reference linear attention.
- **CPU**: the compiled extension (`install_cpu_kernels`): attention and linear attention from the pools, and
  the vision tower's (bf16); with bf16 weights also the matmuls, norms, RoPE, SwiGLU, sparse MoE blocks and the
  one-call decode stack. With or without it, oneDNN's packed linears for the vision tower (`biased_linear`).
- **CUDA**: the Triton kernels: attention, fused norms / RoPE / SwiGLU, the residual add + norm, fused MoE,
  int8/int4 and fp8 matmuls, linear attention, the LoRA adapters' segmented matmul.
Every module of a model shares the one object, so a change of kernels is one assignment here, not a walk over
the modules: the CPU kernels compiled while the server answers on torch's ops swap in through
`install_cpu_kernels` (engine/runner.py calls it between steps). The fields are plain slots, read once per
call: a module pays one attribute load for its kernel.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mili_openai.kernels.cpu import ATTENTION_HEAD_DIMS, CpuKernels, SparseMoeWeights
from mili_openai.kernels.cpu_avx2 import Avx2Kernels
from mili_openai.kernels.cpu_image_attention import CpuImageAttention
from mili_openai.kernels.fp8 import Fp8Weights, torch_fp8_linear
from mili_openai.kernels.linear_attention import LinearAttentionKernel, TorchLinearAttention
from mili_openai.kernels.lora import LoraRows, LoraSlotTable, add_lora
from mili_openai.kernels.quantized import PackedWeights, reference_linear
from mili_openai.model.paged_attention import AttentionKernel

# (x (..., in), weight (out, in)) -> (..., out); F.linear or a kernel with the same contract
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (x (..., K), packed weight) -> (..., N): the CPU kernels, Triton on CUDA, or the torch reference
QuantizedMatmulFn = Callable[[torch.Tensor, PackedWeights], torch.Tensor]
Fp8MatmulFn = Callable[[torch.Tensor, Fp8Weights], torch.Tensor]  # the same, for fp8 weights
# (out (T, O), x (T, I), one projection's adapter slots, the step's rows by slot) -> out with each row's adapter
# delta added in place: the segmented LoRA matmul (kernels/lora.py), the CPU kernel or Triton's (kernels/triton_lora.py)
LoraFn = Callable[[torch.Tensor, torch.Tensor, LoraSlotTable, LoraRows], torch.Tensor]


class FusedOpKernel(Protocol):
    """Compiled RMSNorm, q/k norm + RoPE and SwiGLU's activation with transformers' rounding (see
    mili_openai.kernels.CpuKernels)."""

    def supports_rms_norm(self, x: torch.Tensor) -> bool: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def supports_qk_norm_rope(self, qk: torch.Tensor) -> bool: ...

    def qk_norm_rope(self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                     eps: float, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor: ...

    def supports_silu_mul(self, gate_up: torch.Tensor) -> bool: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class ResidualNormKernel(Protocol):
    """A residual add and the RMSNorm after it in one pass (the Triton kernels on CUDA): h = x + residual
    rounded as torch's add rounds it, written over x, and the norm of h with `FusedOpKernel.rms_norm`'s
    rounding."""

    def supports_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...


class ExpertsKernel(Protocol):
    """Every routed (token, expert) pair's SwiGLU in grouped launches (see mili_openai.kernels.triton_moe)."""

    def fused_experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor: ...


class SparseMoeKernel(Protocol):
    """The router and the experts of a sparse block in one compiled call (see mili_openai.kernels.CpuKernels)."""

    def supports_sparse_moe(self, x: torch.Tensor, gate_up: torch.Tensor) -> bool: ...

    def sparse_moe(self, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   top_k: int, normalize: bool, expert_load: torch.Tensor) -> torch.Tensor: ...


class ZeroCenteredNormKernel(Protocol):
    """Qwen3.5's zero-centred RMSNorm with the residual add before it (see mili_openai.kernels.CpuKernels)."""

    def zero_centered_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                               residual: torch.Tensor | None) -> torch.Tensor | None:
        """`ZeroCenteredRMSNorm` of x (after x += residual where given), rounded as it rounds; None where the
        kernel does not take these inputs (x left untouched)."""
        ...


class BiasedLinearKernel(Protocol):
    """activation(x @ W.T + b) in one call on a weight packed ahead (oneDNN: kernels/onednn_linear.py)."""

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool: ...

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Any: ...

    def linear(self, x: torch.Tensor, packed: Any, activation: str | None = None) -> torch.Tensor: ...


class ImageAttentionKernel(Protocol):
    """Each image frame's patches attending to its own, bidirectionally (kernels/cpu_image_attention.py)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frames: int) -> torch.Tensor | None:
        """q, k, v (frames * L, H, D) -> (frames * L, H, D); None where it does not run these inputs."""
        ...


class DecodeStack(Protocol):
    """The embedding and every decoder layer of a decode-only step in one compiled call (see
    mili_openai.kernels.cpu_decode_stack.CpuDecodeStack)."""

    max_rows: int  # decode batches up to this size; larger ones run layer by layer

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pools: torch.Tensor,
                slot_mapping: torch.Tensor, page_table: torch.Tensor, page_size: int,
                ctx_lens: torch.Tensor) -> torch.Tensor: ...


class DecodeStackKernel(Protocol):
    def decode_stack(self, embedding: PackedWeights, norms: list[torch.Tensor], linears: list[PackedWeights],
                     sparse: list[SparseMoeWeights | None], num_q_heads: int, num_kv_heads: int, head_dim: int,
                     eps: float, scale: float) -> DecodeStack | None: ...


@dataclass(slots=True, eq=False)
class KernelBackend:
    """The kernels a model's layers call; None (or the torch function) where torch's form runs. See the module
    docstring for who fills which field."""

    matmul: MatmulFn = F.linear  # dense projections, grouped experts, the LM head (and a reranker's rows), vision
    quantized_matmul: QuantizedMatmulFn = reference_linear  # int8 / int4 projections
    fp8_matmul: Fp8MatmulFn = torch_fp8_linear  # fp8 projections
    attention: AttentionKernel | None = None  # paged decode and prefill attention; None: torch's SDPA
    fused_ops: FusedOpKernel | None = None  # RMSNorm, q/k norm + RoPE, SwiGLU's activation
    residual_norm: ResidualNormKernel | None = None  # a residual add and the RMSNorm after it
    experts: ExpertsKernel | None = None  # every routed expert in grouped launches (CUDA)
    sparse_moe: SparseMoeKernel | None = None  # router + experts in one call (CPU, bf16)
    decode_stack: DecodeStackKernel | None = None  # builds the one-call decode step (CPU, bf16, one rank)
    zero_centered_norm: ZeroCenteredNormKernel | None = None  # the hybrids' norms (+ residual add), CPU
    linear_attention: LinearAttentionKernel = field(default_factory=TorchLinearAttention)  # Gated DeltaNet's ops
    # the vision tower's projections (bias and GELU fused) on CPU; None: `matmul`, then the bias and activation
    biased_linear: BiasedLinearKernel | None = None
    image_attention: ImageAttentionKernel | None = None  # the vision tower's attention; None: torch's SDPA
    lora: LoraFn = add_lora  # adapters' deltas over a mixed batch (torch's segmented matmul; CPU bf16, CUDA: kernels)
    # the compiled CPU kernels are building on a thread: torch's ops serve until they come in (backend_setup.py)
    awaits_cpu_kernels: bool = False

    def install_cpu_kernels(self, kernels: CpuKernels, dtype: torch.dtype) -> None:
        """Run on the compiled CPU kernels: attention and linear attention always, the rest only with bf16
        weights (the extension's matmuls, norms and MoE blocks are bf16). The model's decode stack, built from
        its weights, follows with `build_decode_stack` (model/backend_setup.py's `use_cpu_kernels`)."""
        self.attention = kernels
        self.image_attention = CpuImageAttention(kernels, ATTENTION_HEAD_DIMS)
        self.linear_attention = kernels.linear_attention
        self.zero_centered_norm = kernels
        if dtype != torch.bfloat16:
            return
        self.matmul = kernels.linear
        self.quantized_matmul = kernels.quantized.linear
        self.fused_ops = kernels
        self.sparse_moe = kernels
        self.decode_stack = kernels
        self.lora = kernels.add_lora

    def install_avx2_kernels(self, kernels: Avx2Kernels, dtype: torch.dtype) -> None:
        """Run on the AVX2 set (a CPU without AVX-512): linear attention always (it falls back to torch's ops for
        dtypes and shapes it lacks), a vision tower's projections where it has them (they compute in fp32 on such
        a CPU), the matmuls only with bf16 weights."""
        self.linear_attention = kernels.linear_attention
        if self.biased_linear is not None:
            self.biased_linear = kernels.biased_linear
        if dtype == torch.bfloat16:
            self.matmul = kernels.linear


def require_backend(backend: KernelBackend) -> KernelBackend:
    """`backend`, checked: a module built without the model's backend would run torch's ops whatever the device
    holds, silently slower (or, on a device the torch form cannot serve, wrong), so it fails at construction."""
    if not isinstance(backend, KernelBackend):
        raise TypeError(f"a model module takes the model's KernelBackend (model/kernel_backend.py), got "
                        f"{type(backend).__name__}")
    return backend
