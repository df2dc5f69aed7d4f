"""Loads the compiled CPU kernels and decides, per call, whether they apply."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import torch

from mili_openai.kernels.build_lock import build_directory, compile_extension, extension_name
from mili_openai.kernels.cpu_avx2 import avx2_kernels_built, compiled_avx2_kernels
from mili_openai.kernels.cpu_decode_stack import CpuDecodeStack
from mili_openai.kernels.cpu_linear_attention import CpuLinearAttention
from mili_openai.kernels.lora import LoraRows, LoraSlotTable, add_lora
from mili_openai.kernels.plan_cache import kernel_plan
from mili_openai.kernels.planning import (
    KernelPlan,
    linear_by_rows,
    plan_decode_prefetch,
    plan_matmuls,
    plan_prefill_attention,
)
from mili_openai.kernels.quantized import CpuQuantizedLinear, PackedWeights

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp", "linear_bf16.cpp", "linear_amx.cpp", "paged_decode_attention.cpp",
           "decode_shared_amx.cpp", "paged_prefill_attention.cpp", "prefill_amx.cpp", "rms_norm_bf16.cpp",
           "activation_bf16.cpp", "moe_experts.cpp", "moe_block.cpp", "decode_stack.cpp", "sample_rows.cpp",
           "gated_deltanet.cpp", "zero_centered_norm.cpp", "lora_bf16.cpp")
QUANTIZED_SOURCES = ("linear_quantized.cpp", "linear_int8.cpp", "linear_int4.cpp", "linear_w8a8.cpp")
# not compiled on their own (torch's JIT hashes only the sources); the build's name hashes every file in csrc
HEADERS = ("attention_pages.h", "simd_bf16.h", "kernels.h", "prefill_products.h", "decode_blocks.h", "row_ranges.h",
           "amx_tiles.h", "decode_shared_amx.h", "decode_partials.h", "prefill_amx.h", "quantized_linear.h",
           "quantized_tiles.h", "moe.h", "expert_tiles.h", "vectors_avx512.h", "gated_deltanet_common.h",
           "gated_delta_rule_ops.h", "gated_deltanet_layer.h")
EXTENSION_PREFIX = "mili_cpu_kernels"
# -fopenmp: without it ATen's parallel_for compiles to a serial loop inside the extension
COMPILE_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl"]
LINK_FLAGS = ["-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
# fp32 values per AVX-512 register: the kernels work in whole vectors along K and along normed rows
VECTOR_LANES = 16
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)  # the attention kernels' head sizes (256: Qwen3.5's attention)
DECODE_STACK_HEAD_DIMS = (16, 32, 64, 128)  # the fused decoder keeps a head in registers
ATTENTION_DTYPES = (torch.bfloat16, torch.float32)
ZERO_CENTERED_NORM_DTYPES = (torch.bfloat16, torch.float32)
PREFILL_ATTENTION_MAX_GROUP = 64  # query heads per KV head: a prefill task spreads them over 64 lanes
ROTARY_HEAD_DIM_MULTIPLE, MAX_ROTARY_HEAD_DIM = 32, 256  # the kernel rotates 16-lane halves on the stack


class SparseMoeWeights(NamedTuple):
    """A Qwen3-MoE layer's block as the decode stack takes it (see model/moe.py for the layouts)."""

    router: torch.Tensor  # (E, H)
    gate_up: torch.Tensor  # (E, 2I, H), gate rows first
    down: torch.Tensor  # (E, H, I)
    expert_load: torch.Tensor  # (E,) int64, gains each expert's routed pairs
    top_k: int
    normalize: bool


def cpu_supports_kernels() -> bool:
    """AVX512 F/BW/VL, which the kernels are compiled for (no BF16 extension needed)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in REQUIRED_CPU_FLAGS)


class CpuKernels:
    """Decode-shaped CPU kernels with torch fallbacks outside their domain."""

    def __init__(self, module) -> None:
        self._module = module
        self.plan = KernelPlan()
        self.planned = False  # whether `plan` was chosen (timed, read from the plan cache, or adopted)
        self._bf16_dot_products = bool(module.cpu_has_bf16_dot_products())
        self._amx_tiles = bool(module.cpu_has_amx_tiles())
        self.quantized = CpuQuantizedLinear(module, self._bf16_dot_products, lambda: self.plan,
                                            bool(module.cpu_has_int8_dot_products()))
        self.linear_attention = CpuLinearAttention(module)  # a LinearAttentionKernel (kernels/linear_attention.py)

    @property
    def bf16_dot_products(self) -> bool:
        """Whether prefill attention and matmuls over several rows multiply bf16 pairs (AVX512-BF16) rather
        than widened fp32."""
        return self._bf16_dot_products

    @property
    def amx_tiles(self) -> bool:
        """Whether matmuls over up to 16 rows of x, decode attention over prefixes several sequences share, and
        bf16 prefill attention (head_dim 64 or 128) run on AMX tiles (Intel Sapphire Rapids and later)."""
        return self._amx_tiles

    @property
    def max_kernel_rows(self) -> int:
        """Rows of x up to which `linear` runs the kernel (beyond it, a GEMM)."""
        return self.plan.max_kernel_rows

    def timed_plan(self) -> KernelPlan:
        """Choose, by timing on this CPU, how many rows go to the matmul kernel (the GEMM for the rest), in
        which dtypes prefill attention runs the kernel rather than torch's SDPA, and how far ahead decode
        attention prefetches (seconds)."""
        max_rows, large_matmul = plan_matmuls(self._kernel_matmul)
        prefill_dtypes = plan_prefill_attention(self.paged_prefill_attention, ATTENTION_DTYPES)
        prefetch_blocks = plan_decode_prefetch(self._decode_attention)
        return KernelPlan(max_rows, large_matmul, prefill_dtypes, prefetch_blocks)

    def _kernel_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._module.linear_bf16(x, weight, self._bf16_dot_products, self._amx_tiles)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T; few-row bf16 inputs stream the weight once through the kernel."""
        return linear_by_rows(x, weight, self._kernel_matmul, self.plan, VECTOR_LANES)

    @staticmethod
    def supports_rms_norm(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] % VECTOR_LANES == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """bf16(weight * bf16(x / rms(x))) over the last dim, one pass per row."""
        return self._module.rms_norm_bf16(x.contiguous(), weight.to(x.dtype).contiguous(), eps)

    def zero_centered_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                               residual: torch.Tensor | None) -> torch.Tensor | None:
        """Qwen3.5's zero-centred RMSNorm (model/hybrid_norms.py), after x += residual where given; None outside
        the kernel's domain (x untouched)."""
        if not (x.device.type == "cpu" and x.dtype in ZERO_CENTERED_NORM_DTYPES and x.dim() in (2, 3)
                and x.stride(-1) == 1 and x.shape[-1] % VECTOR_LANES == 0
                and (residual is None or (x.is_contiguous() and residual.is_contiguous()
                                          and residual.dtype == x.dtype and residual.shape == x.shape))):
            return None
        return self._module.zero_centered_rms_norm(x, weight, eps, residual)

    @staticmethod
    def supports_silu_mul(gate_up: torch.Tensor) -> bool:
        return (gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16
                and gate_up.shape[-1] % (2 * VECTOR_LANES) == 0)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(..., 2I) with gate first -> bf16(bf16(silu(gate)) * up), (..., I)."""
        return self._module.silu_mul_bf16(gate_up.contiguous())

    @staticmethod
    def supports_sparse_moe(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
        """bf16 on CPU, hidden and each rank's expert intermediate size whole vectors (gate_up is (E, 2I, H))."""
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16
                and x.shape[-1] % VECTOR_LANES == 0 and gate_up.shape[1] % (2 * VECTOR_LANES) == 0)

    def sparse_moe(self, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   top_k: int, normalize: bool, expert_load: torch.Tensor) -> torch.Tensor:
        """x (T, H), router (E, H), gate_up (E, 2I, H) gate rows first, down (E, H, I) -> (T, H), each routed
        expert read once; `expert_load` (E,) int64 gains each expert's pairs. Rounds as the torch path does
        (model/moe.py), the routing's ties aside."""
        return self._module.sparse_moe_bf16(x, router.to(x.dtype).contiguous(), gate_up, down, top_k, normalize,
                                            expert_load, self._bf16_dot_products)

    @staticmethod
    def supports_qk_norm_rope(qk: torch.Tensor) -> bool:
        head_dim = qk.shape[-1]
        return (qk.device.type == "cpu" and qk.dtype == torch.bfloat16
                and head_dim % ROTARY_HEAD_DIM_MULTIPLE == 0 and head_dim <= MAX_ROTARY_HEAD_DIM)

    def qk_norm_rope(self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                     eps: float, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """qk (T, Hq + Hk, D): q heads normalised by q_weight, k heads by k_weight, then rotated."""
        qk = qk if qk.stride(-1) == 1 and qk.stride(-2) == qk.shape[-1] else qk.contiguous()  # rows may lie apart
        return self._module.qk_norm_rope_bf16(qk, q_weight.to(qk.dtype).contiguous(),
                                              k_weight.to(qk.dtype).contiguous(), num_q_heads, eps,
                                              cos.contiguous(), signed_sin.contiguous())

    @staticmethod
    def supports_decode_attention(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        return (
            q.device.type == "cpu"
            and q.dtype in ATTENTION_DTYPES
            and k_pool.dtype == q.dtype
            and q.shape[-1] in ATTENTION_HEAD_DIMS
            and k_pool.is_contiguous()
        )

    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               page_table: torch.Tensor, page_size: int, ctx_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, D), each row against positions [0, ctx_lens[b]) of its page table row -> (B, H, D), into
        `out` where given (contiguous)."""
        return self._decode_attention(q, k_pool, v_pool, page_table, page_size, ctx_lens, scale,
                                      self.plan.decode_prefetch_blocks, out)

    def _decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                          page_size: int, ctx_lens: torch.Tensor, scale: float, prefetch_blocks: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        pairs = self._bf16_dot_products and q.dtype == torch.bfloat16
        q = q.contiguous()
        out = torch.empty_like(q) if out is None else out
        self._module.paged_decode_attention(q, k_pool, v_pool, page_table, page_size, ctx_lens, scale, pairs,
                                            pairs and self._amx_tiles, prefetch_blocks, out)
        return out

    def supports_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        """Whether prefill attention runs here: the kernel takes the shapes and, timed at load, beats SDPA."""
        return q.dtype in self.plan.prefill_attention_dtypes and self.prefill_attention_fits(q, k_pool)

    @staticmethod
    def prefill_attention_fits(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        num_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
        return (
            CpuKernels.supports_decode_attention(q, k_pool)
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]  # each row's heads contiguous, rows may stride
            and num_heads // num_kv_heads <= PREFILL_ATTENTION_MAX_GROUP
        )

    def paged_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                page_table: torch.Tensor, page_size: int, cu_seqlens: torch.Tensor,
                                ctx_lens: torch.Tensor, max_length: int, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, H, D), chunk s its rows [cu_seqlens[s], cu_seqlens[s + 1]), each the last rows of a context of
        ctx_lens[s] tokens on page table row s -> causal attention over each context, (T, H, D), into `out`
        where given (contiguous). max_length: the Triton kernels' grid size, not needed here."""
        pairs = self._bf16_dot_products and q.dtype == torch.bfloat16
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        self._module.paged_prefill_attention(q, k_pool, v_pool, page_table, page_size, cu_seqlens, ctx_lens, scale,
                                             pairs, pairs and self._amx_tiles, out)
        return out

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token per row of float32 logits (R, V): temperature, then top-k (V where off), top-p and min-p
        as the sampler's torch path cuts them, then an inverse-CDF draw with the row's uniform (float64)."""
        return self._module.sample_rows(logits.contiguous(), temperature, top_k, top_p, min_p, uniform)

    def truncation_thresholds(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                              top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """(R,) the lowest logit / temperature each row keeps after `sample_rows`' cuts (-inf: no cut)."""
        return self._module.truncation_thresholds(logits.contiguous(), temperature, top_k, top_p, min_p)

    def decode_stack(self, embedding: PackedWeights, norms: list[torch.Tensor], linears: list[PackedWeights],
                     sparse: list[SparseMoeWeights | None], num_q_heads: int, num_kv_heads: int, head_dim: int,
                     eps: float, scale: float) -> CpuDecodeStack | None:
        """The embedding lookup and every decoder layer of a decode step in one call, or None where a kernel
        cannot run the shapes or the weights.

        norms: per layer input norm, q norm, k norm, post-attention norm; linears: per layer qkv, o, and for a
        dense layer gate_up, down (bf16, int8 or int4, int8 with int8 inputs); sparse: per layer its MoE block,
        or None (dense); embedding: bf16, or int8 or int4 rows (an LM head it is tied to).
        """
        hidden_size = norms[0].shape[0]
        probe = torch.empty(1, hidden_size, dtype=torch.bfloat16)
        supported = (
            all(w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() for w in norms)
            and all(self.quantized.supports(w) and w.weight.is_contiguous() for w in (embedding, *linears))
            and all(self.supports_sparse_moe(probe, block.gate_up) for block in sparse if block is not None)
            and head_dim in DECODE_STACK_HEAD_DIMS
            and head_dim % ROTARY_HEAD_DIM_MULTIPLE == 0
            and hidden_size % VECTOR_LANES == 0
            and all(w.in_features % VECTOR_LANES == 0 for w in linears)
        )
        if not supported:
            return None
        blocks = [self._module.SparseMoeLayer() if block is None else
                  self._module.SparseMoeLayer(block.router.contiguous(), block.gate_up, block.down, block.expert_load,
                                              block.top_k, block.normalize) for block in sparse]
        stack = self._module.DecodeStack(self._packed_linear(embedding), norms,
                                         [self._packed_linear(w) for w in linears], blocks, num_q_heads,
                                         num_kv_heads, head_dim, eps, scale, self._bf16_dot_products,
                                         self._amx_tiles, self.plan.decode_prefetch_blocks)
        return CpuDecodeStack(stack, self)

    def lora_projection(self, table: LoraSlotTable | None):
        """The compiled record of one projection's LoRA slots (an empty one for None)."""
        if table is None:
            return self._module.LoraProjection()
        return self._module.LoraProjection(table.lora_a, table.lora_b, list(table.offsets))

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, table: LoraSlotTable, rows: LoraRows) -> torch.Tensor:
        """out (T, O) += each row's slot's delta, in place: bf16 rows in one call, rounded as kernels/lora.py's
        torch ops, which run what `supports_lora` declines."""
        if not self.supports_lora(x, table):
            return add_lora(out, x, table, rows)
        self._module.add_lora_bf16(out, x, table.lora_a, table.lora_b, rows.per_row(x.shape[0], x.device),
                                   list(table.offsets))
        return out

    @staticmethod
    def supports_lora(x: torch.Tensor, table: LoraSlotTable) -> bool:
        return (x.dtype == table.lora_a.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
                and x.stride(1) == 1 and x.shape[1] % VECTOR_LANES == 0)

    def _packed_linear(self, packed: PackedWeights):
        empty = torch.empty(0)
        if packed.bits == 16:
            return self._module.PackedLinear(16, packed.weight, empty, empty, False, empty)
        weight, scales, *last = self.quantized.kernel_arguments(packed)  # int4: zeros; W8A8: the static scale
        if packed.int8_inputs is not None:
            return self._module.PackedLinear(8, weight, scales, empty, True, last[0])
        return self._module.PackedLinear(packed.bits, weight, scales, last[0] if last else empty, False, empty)


def load_cpu_kernels(plan_cache: bool = True) -> CpuKernels | None:
    """Build (once per machine, cached by torch) and load the kernels, and plan their use once per process
    (unless a plan was adopted); None when they cannot be had. `plan_cache` (EngineConfig.kernel_plan_cache):
    read the plan an earlier start timed on this machine, else time it and keep it (kernels/plan_cache.py);
    off, time it here. The first call in a process decides."""
    kernels = _compiled_kernels()
    if kernels is None or kernels.planned:
        return kernels
    name = extension_name(EXTENSION_PREFIX, SOURCE_DIR)
    kernels.plan = kernel_plan(build_directory(name, SOURCE_DIR), name, kernels.timed_plan, plan_cache)
    kernels.planned = True
    logger.info("CPU kernels: matmuls of up to %d rows (%s), prefill attention in %s, decode attention "
                "prefetch distance %d (blocks of 16 slots)", kernels.max_kernel_rows,
                "AMX tiles up to 16" if kernels.amx_tiles else "AVX-512",
                sorted(str(dtype) for dtype in kernels.plan.prefill_attention_dtypes) or "torch's SDPA",
                kernels.plan.decode_prefetch_blocks)
    return kernels


def adopt_cpu_kernel_plan(plan: KernelPlan) -> None:
    """Use `plan`, timed by another process on this machine, rather than timing one (seconds): for
    tensor-parallel workers, which then also all choose alike. Call before `load_cpu_kernels`."""
    kernels = _compiled_kernels()
    if kernels is not None:
        kernels.plan = plan
        kernels.planned = True


def cpu_kernels_built() -> bool:
    """Whether loading the kernels takes a moment rather than a compile (minutes): they are built
    for this checkout's sources, or this CPU cannot run them."""
    if not cpu_supports_kernels():
        return avx2_kernels_built()  # where the CPU has AVX2 but not AVX-512, the few kernels it can run
    name = extension_name(EXTENSION_PREFIX, SOURCE_DIR)
    return (build_directory(name, SOURCE_DIR) / f"{name}.so").is_file()


def build_cpu_kernels_in_background() -> Future[bool]:
    """Compile and load the kernels on a thread of their own; the future says whether they can be had.
    Nothing is planned there: `load_cpu_kernels` times the plan on the thread that then runs them (a torch op
    on another thread would start a second OpenMP team, engine/async_engine.py)."""
    built: Future[bool] = Future()

    def build() -> None:
        try:
            built.set_result(_compiled_kernels() is not None or compiled_avx2_kernels() is not None)
        except BaseException as exc:  # a bug, not a missing compiler (that one is a False)
            built.set_exception(exc)

    threading.Thread(target=build, name="mili-kernel-build", daemon=True).start()
    return built


@functools.lru_cache(maxsize=1)
def _compiled_kernels() -> CpuKernels | None:
    if not cpu_supports_kernels():
        return None
    compiling = not cpu_kernels_built()
    start = time.monotonic()
    if compiling:
        logger.info("compiling CPU kernels (first start only)…")
    module = compile_extension(EXTENSION_PREFIX, SOURCE_DIR, SOURCES + QUANTIZED_SOURCES, COMPILE_FLAGS, LINK_FLAGS)
    if module is None:
        return None
    if compiling:
        logger.info("compiling CPU kernels (first start only)… done in %.0f s", time.monotonic() - start)
    return CpuKernels(module)
