"""Fill a loaded model's `KernelBackend` (model/kernel_backend.py) for its device, once, at load.

- CPU: the compiled extension (`use_cpu_kernels`), unless the caller may defer it and it is not built yet: then
  the backend `awaits_cpu_kernels` (they compile on a thread while the server answers on torch's ops, then swap
  in through `use_cpu_kernels` between steps). int8/int4 weights never wait so: on torch's ops they would be
  dequantized in float32 at every call, many times slower than the bf16 fallback, and a loaded server may never
  be idle to switch.
- CPU, a vision tower: its projections on oneDNN's packed linears (kernels/onednn_linear.py), compiled kernels or
  not.
- CUDA: the Triton kernels (LoRA's segmented matmul among them), each where it builds for the model's shapes (a
  Triton too old for one leaves that op on torch with a warning), then every kernel variant compiled by warm-up
  forwards.
- `attention_backend` "torch": torch's SDPA for attention on CUDA; "triton": Triton attention or an error
  (and the CPU under Triton's interpreter).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from mili_openai.kernels.lora import LoraGroup, LoraRows, LoraSlotTable
from mili_openai.kernels.onednn_linear import bf16_supported, onednn_linear
from mili_openai.model.config import ModelConfig
from mili_openai.model.huge_pages import move_parameters_to_huge_pages
from mili_openai.model.kernel_backend import LoraFn
from mili_openai.model.kernel_warmup import warm_up_kernels
from mili_openai.model.quantization.modules import Fp8Linear
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM

if TYPE_CHECKING:
    from mili_openai.kernels import CpuKernels
    from mili_openai.kernels.triton_attention import TritonAttention

logger = logging.getLogger(__name__)

PROBE_EPS = 1e-6  # the norms' epsilon in the one-row compile probes (any value compiles the same kernel)
PROBE_LORA_RANK = 16  # the LoRA probe's slot width and output columns (any compile the same kernels)


def set_up_backend(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, rank_config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, use_decode_kernel: bool, attention_backend: str,
                   defer_cpu_kernels: bool, kernel_plan_cache: bool) -> None:
    """Huge pages on CPU, then each compiled kernel the device has into `model.backend` (see load_model;
    `defer_cpu_kernels`: the CPU kernels may come later, see the module docstring; `kernel_plan_cache`: see
    kernels/cpu.py's `load_cpu_kernels`)."""
    if device.type == "cpu":
        move_parameters_to_huge_pages(model)
    backend = model.backend
    if device.type == "cpu" and getattr(model, "visual", None) is not None:  # a classifier has none
        backend.biased_linear = onednn_linear()
        if model.dtype == torch.bfloat16 and not bf16_supported():  # no bf16 arithmetic here: fp32 is faster
            model.visual.compute_in(torch.float32)
    triton_attention = None
    if attention_backend == "triton" or (attention_backend == "auto" and device.type == "cuda"):
        triton_attention = _triton_attention(rank_config, dtype, device, required=attention_backend == "triton")
        backend.attention = triton_attention
    elif use_decode_kernel and device.type == "cpu":
        _use_or_await_cpu_kernels(model, defer_cpu_kernels, kernel_plan_cache)
    if device.type == "cuda":
        _use_cuda_kernels(model, rank_config)
    if device.type == "cuda" and triton_attention is not None:
        start = time.perf_counter()
        decode_rows = triton_attention.decode_split_rows(rank_config.num_key_value_heads)
        forwards = warm_up_kernels(model, rank_config, decode_rows, device)
        logger.info("compiled the Triton kernels for every step shape in %.1f s (%d warm-up forwards)",
                    time.perf_counter() - start, forwards)


def _use_or_await_cpu_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, defer: bool, plan_cache: bool) -> None:
    # only worth building (and only possible) on CPU; read at call time, so a test can stand in for the build
    from mili_openai import kernels

    if defer and model.parallel is None and not kernels.cpu_kernels_built():
        if not model.holds_packed_weights:
            model.backend.awaits_cpu_kernels = True
            return
        logger.info("quantized weights: compiling the CPU kernels before serving")
    use_cpu_kernels(model, kernels.load_cpu_kernels(plan_cache))


def use_cpu_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, kernels: CpuKernels | None) -> None:
    """Run the model's CPU work through the compiled kernels (None: torch's ops stay): the backend's fields, then
    the decode stack built from the weights. The one place the CPU kernels come in, at load or later."""
    model.backend.awaits_cpu_kernels = False
    if kernels is None:
        _use_avx2_kernels(model)
        return
    model.backend.install_cpu_kernels(kernels, model.dtype)
    model.build_decode_stack()


def _use_avx2_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM) -> None:
    """Where the CPU lacks the AVX-512 kernels, the AVX2 ones (kernels/cpu_avx2.py): a bf16 model's projections
    (torch's bf16 GEMM there runs at a few GFLOP/s), and Gated DeltaNet's ops in every dtype they take, as
    `install_cpu_kernels` installs the AVX-512 set's."""
    from mili_openai.kernels import cpu_avx2, cpu_supports_kernels

    bf16, hybrid = model.dtype == torch.bfloat16, model.config.hybrid is not None
    if cpu_supports_kernels() or not (bf16 or hybrid):  # an fp32 Qwen3 has nothing for them
        return
    avx2 = cpu_avx2.load_avx2_kernels()
    if avx2 is not None:
        model.backend.install_avx2_kernels(avx2, model.dtype)


def _triton_attention(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                      required: bool) -> TritonAttention | None:
    """The Triton page-table attention kernels, where they run the model's shapes; where they cannot, a
    ValueError if `required`, else None (torch's SDPA stays)."""
    try:
        from mili_openai.kernels.triton_attention import TritonAttention
    except ImportError as exc:  # torch's CUDA wheels ship Triton; a CPU install may not have it
        if required:
            raise ValueError(f"the Triton attention backend needs the triton package: {exc}") from exc
        logger.warning("Triton is not installed: attention runs through torch's SDPA")
        return None
    kernel = TritonAttention()
    probe_q = torch.empty(1, config.num_attention_heads, config.head_dim, dtype=dtype, device=device)
    probe_pool = torch.empty(1, config.num_key_value_heads, config.head_dim, dtype=dtype, device=device)
    if kernel.supports_paged_attention(probe_q, probe_pool):
        return kernel
    reason = (f"the Triton attention kernels run on {kernel.device_type} (the CPU only under TRITON_INTERPRET=1), "
              f"in float16, bfloat16 or float32, head_dim <= 256; this model is {dtype} on {device.type}, head_dim "
              f"{config.head_dim}, {config.num_attention_heads} query and {config.num_key_value_heads} KV heads")
    if required:
        raise ValueError(reason)
    logger.warning("%s: attention runs through torch's SDPA", reason)
    return None


def _use_cuda_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, config: ModelConfig) -> None:
    """RMSNorm (with the residual add before it), q/k norm + RoPE, SwiGLU's activation, the experts, int8/int4
    and fp8 projections, linear attention and the LoRA adapters' deltas through the Triton kernels, where Triton
    is there (else the torch forms)."""
    from mili_openai.kernels.triton_fp8 import triton_fp8_linear
    from mili_openai.kernels.triton_fused_ops import TritonFusedOps
    from mili_openai.kernels.triton_lora import triton_add_lora
    from mili_openai.kernels.triton_quantized import triton_quantized_linear

    backend = model.backend
    if config.moe is not None:
        backend.experts = _triton_moe()
    if TritonFusedOps is not None and _fused_ops_compile(TritonFusedOps(), model):
        backend.fused_ops = TritonFusedOps()
    if TritonFusedOps is not None and _residual_norm_compiles(TritonFusedOps(), model):
        backend.residual_norm = TritonFusedOps()
    if triton_quantized_linear is not None:
        backend.quantized_matmul = triton_quantized_linear
    fp8 = next((module for module in model.modules() if isinstance(module, Fp8Linear)), None)
    if fp8 is not None and triton_fp8_linear is not None and _fp8_kernels_compile(fp8, model.dtype):
        backend.fp8_matmul = triton_fp8_linear
    if config.hybrid is not None:
        _use_triton_linear_attention(model)
    if triton_add_lora is not None and _lora_kernel_compiles(triton_add_lora, model):
        backend.lora = triton_add_lora


def _use_triton_linear_attention(model: Qwen3_5ForCausalLM) -> None:
    """Gated DeltaNet's conv and delta rule through the Triton kernels (without Triton, torch's ops stay)."""
    from mili_openai.kernels.triton_gated_delta_rule import TritonLinearAttention

    if TritonLinearAttention is None:
        logger.warning("Triton is not installed: Gated DeltaNet runs as torch ops")
        return
    model.backend.linear_attention = TritonLinearAttention()


def _triton_moe():
    """The Triton fused-MoE kernel; None without Triton (the grouped torch matmuls stay)."""
    try:
        from mili_openai.kernels.triton_moe import TritonMoe
    except ImportError as exc:
        logger.warning("Triton is not installed: the experts run as torch matmuls (%s)", exc)
        return None
    return TritonMoe()


def _fused_ops_compile(kernel, model: Qwen3ForCausalLM | Qwen3_5ForCausalLM) -> bool:
    """Run each fused op once on a row of the model's shapes: a Triton that cannot build them (too old for
    this code, say) leaves the torch forms in place with a warning instead of failing every step."""
    config, weight = model.config, model.model.norm.weight
    heads = config.num_attention_heads + config.num_key_value_heads
    row = torch.zeros(1, config.hidden_size, dtype=weight.dtype, device=weight.device)
    qk = torch.zeros(1, heads, config.head_dim, dtype=weight.dtype, device=weight.device)
    rotary = torch.zeros(1, 1, config.head_dim, dtype=weight.dtype, device=weight.device)
    try:
        kernel.rms_norm(row, weight, PROBE_EPS)
        kernel.qk_norm_rope(qk, qk[0, 0], qk[0, 0], config.num_attention_heads, PROBE_EPS, rotary, rotary)
        kernel.silu_mul(torch.cat((row, row), dim=-1))
    except Exception as exc:  # noqa: BLE001 -- a compile failure surfaces as any of Triton's exception types
        logger.warning("the Triton norm/RoPE/activation kernels do not build here (%s): they run as torch ops", exc)
        return False
    return True


def _residual_norm_compiles(kernel, model: Qwen3ForCausalLM | Qwen3_5ForCausalLM) -> bool:
    """As `_fused_ops_compile`, for the residual add + RMSNorm kernel (its failure leaves the other ops be)."""
    weight = model.model.norm.weight
    row = torch.zeros(1, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
    try:
        kernel.add_rms_norm(row.clone(), row, weight, PROBE_EPS)
    except Exception as exc:  # noqa: BLE001 -- as in _fused_ops_compile
        logger.warning("the Triton residual add + RMSNorm kernel does not build here (%s): it runs as torch ops",
                       exc)
        return False
    return True


def _fp8_kernels_compile(layer: Fp8Linear, dtype: torch.dtype) -> bool:
    """As `_fused_ops_compile`, for the fp8 kernels (both of them, on one row of the layer's shapes): a Triton
    or GPU without them leaves the torch paths."""
    from mili_openai.kernels.triton_fp8 import quantize_rows, triton_fp8_linear

    row = torch.zeros(1, layer.weight.shape[1], dtype=dtype, device=layer.weight.device)
    try:
        triton_fp8_linear(row, layer.fp8)
        quantize_rows(row)
    except Exception as exc:  # noqa: BLE001 -- as in _fused_ops_compile
        logger.warning("the Triton fp8 kernels do not build here (%s): fp8 projections run through torch", exc)
        return False
    return True


def _lora_kernel_compiles(kernel: LoraFn, model: Qwen3ForCausalLM | Qwen3_5ForCausalLM) -> bool:
    """As `_fused_ops_compile`, for the LoRA kernels (one row, one slot of the model's width): a Triton that cannot
    build them leaves torch's segmented matmul for the adapters."""
    weight = model.model.norm.weight
    zeros = dict(dtype=weight.dtype, device=weight.device)
    table = LoraSlotTable(torch.zeros(1, PROBE_LORA_RANK, weight.shape[0], **zeros),
                          torch.zeros(1, PROBE_LORA_RANK, PROBE_LORA_RANK, **zeros), (0, PROBE_LORA_RANK))
    try:
        kernel(torch.zeros(1, PROBE_LORA_RANK, **zeros), torch.zeros(1, weight.shape[0], **zeros), table,
               LoraRows([LoraGroup(0, None)]))
    except Exception as exc:  # noqa: BLE001 -- as in _fused_ops_compile
        logger.warning("the Triton LoRA kernels do not build here (%s): adapters run as torch matmuls", exc)
        return False
    return True
