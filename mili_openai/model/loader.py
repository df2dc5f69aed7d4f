"""Load a Qwen3 checkpoint directory: build the model on the meta device (no memory, no random init),
read `model.safetensors` or the shards named by `model.safetensors.index.json`, map the names, cast,
and assign the tensors in place of the meta parameters. A tensor-parallel rank reads only its slices.
Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints build through model/hybrid_loader.py, then share the kernel setup."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.config import ModelConfig
from mili_openai.model.huge_pages import move_parameters_to_huge_pages
from mili_openai.model.hybrid_loader import build_hybrid_model, check_hybrid_options
from mili_openai.model.kernel_warmup import warm_up_kernels
from mili_openai.model.quantization.apply import load_checkpoint_quantization, quantize_model
from mili_openai.model.quantization.modules import Fp8Linear
from mili_openai.model.quantization.spec import (
    DEFAULT_INT4_GROUP_SIZE,
    check_quantization,
    read_checkpoint_quantization,
)
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.sequence_classifier import Qwen3ForSequenceClassification
from mili_openai.model.tensor_parallel import CheckpointShard, shard_config
from mili_openai.model.vision_loader import check_vision_language_options, take_qwen3_vl_tower
from mili_openai.model.weights import CheckpointError, checkpoint_to_model_state

if TYPE_CHECKING:
    from mili_openai.kernels import CpuKernels
    from mili_openai.kernels.triton_attention import TritonAttention

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
AUTO_DTYPE = torch.bfloat16
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for an `EngineConfig.dtype` name: auto, bfloat16, float16 or float32.

    "auto" is bfloat16 whatever the checkpoint stores: Qwen3 ships in bf16, and following a float32
    checkpoint would double the memory and halve decode speed.
    """
    if name == "auto":
        return AUTO_DTYPE
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the single file, or every shard its index names."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shards that are not there: {', '.join(absent)}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path} holds no weights: neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_checkpoint_tensors(path: Path, rank_slices: CheckpointShard | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, or with `rank_slices`, a tensor-parallel rank's slice of each."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        shard = load_file(str(file), device="cpu") if rank_slices is None else _read_slices(file, rank_slices)
        repeated = tensors.keys() & shard.keys()
        if repeated:
            raise CheckpointError(f"weights stored twice across shards: {', '.join(sorted(repeated))}")
        tensors.update(shard)
    return tensors


def _read_slices(file: Path, rank_slices: CheckpointShard) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt", device="cpu") as stored:
        return {name: rank_slices.read(name, stored.get_slice(name)) for name in stored.keys()}  # noqa: SIM118


def load_model(
    path: str | os.PathLike, dtype: torch.dtype, device: torch.device, use_decode_kernel: bool = True,
    attention_backend: str = "auto", parallel: TensorParallelGroup | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, defer_cpu_kernels: bool = False,
    lm_head_quantization: str | None = None,
) -> tuple[Qwen3ForCausalLM | Qwen3_5ForCausalLM, ModelConfig]:
    """-> (model in eval mode on `device` with weights in `dtype`, its config).

    `parallel`: this process is one rank of a tensor-parallel group; the model holds its shard
    (model/tensor_parallel.py). The config returned is the whole model's.
    `quantization`: int8, int4 (groups of `group_size`) or fp8 (CUDA) weights, quantized from the checkpoint's
    as they load; a checkpoint that config.json declares quantized (fp8, awq, gptq) loads as it is stored
    (model/quantization/spec.py). `model.quantization` says which, if any. Dense models on one rank only.
    `lm_head_quantization`: under int8/int4, the LM head's int8 (None) or int4 (groups of `group_size`).
    `use_decode_kernel`: on a CPU with AVX512, use the compiled kernels: decode and prefill attention from
    the paged pool, and with bf16 weights the matmuls (dense and quantized), RMSNorms, q/k norm + RoPE,
    SwiGLU's activation and MoE blocks (the model falls back to torch when they cannot be built).
    `defer_cpu_kernels`: leave them out; the caller builds them meanwhile and installs them later
    (`use_cpu_kernels`).
    `attention_backend` (EngineConfig.attention_backend): "auto" runs the Triton kernels on CUDA where they
    take the model's shapes; "triton" insists on them (and takes the CPU under Triton's interpreter);
    "torch" keeps torch's SDPA on CUDA.
    """
    directory = Path(path)
    config = ModelConfig.from_pretrained(directory)
    device = torch.device(device)
    checkpoint_quantization = read_checkpoint_quantization(directory)
    check_quantization(quantization, checkpoint_quantization, device.type)
    if config.hybrid is not None:
        check_hybrid_options(config, parallel, quantization, checkpoint_quantization)
        model = build_hybrid_model(config, read_checkpoint_tensors(directory), dtype, device,
                                   str(directory / "config.json"), parallel, checkpoint_quantization)
        if quantization is not None:
            model.quantization = quantize_model(model, quantization, group_size, lm_head_quantization or "int8")
        rank_config = shard_config(config, parallel.size) if parallel is not None else config
        _set_up_kernels(model, rank_config, dtype, device, use_decode_kernel, attention_backend, defer_cpu_kernels)
        return model, config
    if (quantization or checkpoint_quantization) and (parallel is not None or config.moe is not None):
        raise ValueError("quantized weights run dense models on one rank: not with --tensor-parallel-size > 1, "
                         "nor with MoE checkpoints, yet")
    if config.classifier is not None and (quantization or checkpoint_quantization):
        raise ValueError("a sequence-classification checkpoint runs unquantized: not with quantized weights, yet")
    if config.vision is not None:
        check_vision_language_options(config, parallel is not None, bool(quantization or checkpoint_quantization))
    with torch.device("meta"):
        model = (Qwen3ForSequenceClassification if config.classifier is not None else Qwen3ForCausalLM)(config, parallel)
    rank_slices = CheckpointShard(config, parallel.rank, parallel.size) if parallel is not None else None
    tensors = read_checkpoint_tensors(directory, rank_slices)
    visual = None  # Qwen3-VL: the tower apart, the language model's weights under Qwen3's names
    if config.vision is not None:
        visual = take_qwen3_vl_tower(tensors, config, dtype, device, str(directory / "config.json"))
    if checkpoint_quantization is not None:
        model.quantization = load_checkpoint_quantization(model, tensors, checkpoint_quantization, dtype, device)
    placed = {name: t for name, t in model.state_dict().items() if not t.is_meta}  # quantized modules' own
    tensors = {name: t.to(dtype=dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    state = checkpoint_to_model_state(tensors, config, model.state_dict().keys() - placed.keys())
    state = {name: t.to(device) for name, t in state.items()} | placed
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # size mismatches: the config and the weights disagree
        raise CheckpointError(f"checkpoint weights do not fit {directory / 'config.json'}: {exc}") from exc
    model.visual = visual
    model.to(device)  # the RoPE buffer, built on CPU, follows the weights
    model.requires_grad_(False).eval()
    del tensors, state, placed  # the parameters hold the only references: each frees as it moves below
    if quantization is not None and checkpoint_quantization is None:
        model.quantization = quantize_model(model, quantization, group_size, lm_head_quantization or "int8")
    rank_config = shard_config(config, parallel.size) if parallel is not None else config
    _set_up_kernels(model, rank_config, dtype, device, use_decode_kernel, attention_backend, defer_cpu_kernels)
    return model, config


def _set_up_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, rank_config: ModelConfig, dtype: torch.dtype,
                    device: torch.device, use_decode_kernel: bool, attention_backend: str,
                    defer_cpu_kernels: bool) -> None:
    """Huge pages on CPU, then each compiled kernel the device has (see load_model)."""
    if device.type == "cpu":
        move_parameters_to_huge_pages(model)
    triton_attention = None
    if attention_backend == "triton" or (attention_backend == "auto" and device.type == "cuda"):
        triton_attention = _use_triton_attention(model, rank_config, dtype, device,
                                                 required=attention_backend == "triton")
    elif use_decode_kernel and device.type == "cpu" and not defer_cpu_kernels:
        from mili_openai.kernels import load_cpu_kernels  # only worth building (and only possible) on CPU

        use_cpu_kernels(model, dtype, load_cpu_kernels())
    if device.type == "cuda" and rank_config.moe is not None:
        _use_triton_moe(model)
    if device.type == "cuda":
        _use_cuda_kernels(model)
    if rank_config.hybrid is not None:
        if device.type == "cuda":
            _use_triton_linear_attention(model)
        return  # the warm-up below builds Qwen3 batches (no state slots)
    if device.type == "cuda" and triton_attention is not None:
        start = time.perf_counter()
        decode_rows = triton_attention.decode_split_rows(rank_config.num_key_value_heads)
        forwards = warm_up_kernels(model, rank_config, decode_rows, device)
        logger.info("compiled the Triton kernels for every step shape in %.1f s (%d warm-up forwards)",
                    time.perf_counter() - start, forwards)


def _use_triton_linear_attention(model: Qwen3_5ForCausalLM) -> None:
    """Gated DeltaNet's conv and delta rule through the Triton kernels (without Triton, torch's ops stay)."""
    from mili_openai.kernels.triton_gated_delta_rule import TritonLinearAttention

    if TritonLinearAttention is None:
        logger.warning("Triton is not installed: Gated DeltaNet runs as torch ops")
        return
    model.set_linear_attention_kernel(TritonLinearAttention())


def _use_triton_moe(model: Qwen3ForCausalLM) -> None:
    """The experts through the Triton fused-MoE kernel; without Triton, the grouped torch matmuls stay."""
    try:
        from mili_openai.kernels.triton_moe import TritonMoe
    except ImportError as exc:
        logger.warning("Triton is not installed: the experts run as torch matmuls (%s)", exc)
        return
    model.set_experts_kernel(TritonMoe())


def _use_triton_attention(model: Qwen3ForCausalLM, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                          required: bool) -> TritonAttention | None:
    """Attention through the Triton page-table kernels (-> the kernel); where they cannot run, a ValueError if
    `required`, else torch's SDPA stays (-> None)."""
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
        model.set_attention_kernel(kernel)
        return kernel
    reason = (f"the Triton attention kernels run on {kernel.device_type} (the CPU only under TRITON_INTERPRET=1), "
              f"in float16, bfloat16 or float32, head_dim <= 256; this model is {dtype} on {device.type}, head_dim "
              f"{config.head_dim}, {config.num_attention_heads} query and {config.num_key_value_heads} KV heads")
    if required:
        raise ValueError(reason)
    logger.warning("%s: attention runs through torch's SDPA", reason)
    return None


def use_cpu_kernels(model: Qwen3ForCausalLM, dtype: torch.dtype, kernels: CpuKernels | None) -> None:
    """Run the model's CPU work through the compiled kernels (None: torch's ops stay)."""
    if kernels is None:
        return
    model.set_attention_kernel(kernels)
    if isinstance(model, Qwen3_5ForCausalLM):
        model.set_linear_attention_kernel(kernels.linear_attention)
        model.set_zero_centered_norm_kernel(kernels)
    if dtype == torch.bfloat16:
        model.set_matmul(kernels.linear)
        model.set_quantized_matmul(kernels.quantized.linear)
        model.set_fused_op_kernel(kernels)
        model.set_sparse_moe_kernel(kernels)
        model.set_decode_stack_kernel(kernels)


def _fused_ops_compile(kernel, model: Qwen3ForCausalLM) -> bool:
    """Run each fused op once on a row of the model's shapes: a Triton that cannot build them (too old for
    this code, say) leaves the torch forms in place with a warning instead of failing every step."""
    config, weight = model.config, model.model.norm.weight
    heads = config.num_attention_heads + config.num_key_value_heads
    row = torch.zeros(1, config.hidden_size, dtype=weight.dtype, device=weight.device)
    qk = torch.zeros(1, heads, config.head_dim, dtype=weight.dtype, device=weight.device)
    rotary = torch.zeros(1, 1, config.head_dim, dtype=weight.dtype, device=weight.device)
    try:
        kernel.rms_norm(row, weight, 1e-6)
        kernel.qk_norm_rope(qk, qk[0, 0], qk[0, 0], config.num_attention_heads, 1e-6, rotary, rotary)
        kernel.silu_mul(torch.cat((row, row), dim=-1))
    except Exception as exc:  # noqa: BLE001 -- a compile failure surfaces as any of Triton's exception types
        logger.warning("the Triton norm/RoPE/activation kernels do not build here (%s): they run as torch ops", exc)
        return False
    return True


def _residual_norm_compiles(kernel, model: Qwen3ForCausalLM) -> bool:
    """As `_fused_ops_compile`, for the residual add + RMSNorm kernel (its failure leaves the other ops be)."""
    weight = model.model.norm.weight
    row = torch.zeros(1, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
    try:
        kernel.add_rms_norm(row.clone(), row, weight, 1e-6)
    except Exception as exc:  # noqa: BLE001 -- as in _fused_ops_compile
        logger.warning("the Triton residual add + RMSNorm kernel does not build here (%s): it runs as torch ops",
                       exc)
        return False
    return True


def _use_cuda_kernels(model: Qwen3ForCausalLM) -> None:
    """RMSNorm (with the residual add before it), q/k norm + RoPE, SwiGLU's activation and int8/int4
    projections through the Triton kernels, where Triton is there (else the torch forms)."""
    from mili_openai.kernels.triton_fp8 import triton_fp8_linear
    from mili_openai.kernels.triton_fused_ops import TritonFusedOps
    from mili_openai.kernels.triton_quantized import triton_quantized_linear

    if TritonFusedOps is not None and _fused_ops_compile(TritonFusedOps(), model):
        model.set_fused_op_kernel(TritonFusedOps())
    if TritonFusedOps is not None and _residual_norm_compiles(TritonFusedOps(), model):
        model.set_residual_norm_kernel(TritonFusedOps())
    if triton_quantized_linear is not None:
        model.set_quantized_matmul(triton_quantized_linear)
    fp8 = next((module for module in model.modules() if isinstance(module, Fp8Linear)), None)
    if fp8 is not None and triton_fp8_linear is not None and _fp8_kernels_compile(fp8, model.dtype):
        model.set_fp8_matmul(triton_fp8_linear)


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
