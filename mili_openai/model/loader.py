"""Load a Qwen3 checkpoint directory: build the model on the meta device (no memory, no random init),
read `model.safetensors` or the shards named by `model.safetensors.index.json`, map the names, cast,
and assign the tensors in place of the meta parameters. A tensor-parallel rank reads only its slices.
Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints build through model/hybrid_loader.py. Then the model's kernel backend
is filled for the device (model/backend_setup.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.backend_setup import set_up_backend
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_loader import build_hybrid_model, check_hybrid_options
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.quantization.apply import load_checkpoint_quantization, quantize_model
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
    lm_head_quantization: str | None = None, kernel_plan_cache: bool = True,
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
    `defer_cpu_kernels`: where they are not built yet (and the weights are not int8/int4), leave them out: the
    backend `awaits_cpu_kernels`, which the caller builds meanwhile and installs later (model/backend_setup.py's
    `use_cpu_kernels`). `kernel_plan_cache`: how the kernels' plan is had (kernels/cpu.py's `load_cpu_kernels`).
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
        set_up_backend(model, rank_config, dtype, device, use_decode_kernel, attention_backend, defer_cpu_kernels,
                   kernel_plan_cache)
        return model, config
    if (quantization or checkpoint_quantization) and (parallel is not None or config.moe is not None):
        raise ValueError("quantized weights run dense models on one rank: not with --tensor-parallel-size > 1, "
                         "nor with MoE checkpoints, yet")
    if config.classifier is not None and (quantization or checkpoint_quantization):
        raise ValueError("a sequence-classification checkpoint runs unquantized: not with quantized weights, yet")
    if config.vision is not None:
        check_vision_language_options(config, parallel is not None, bool(quantization or checkpoint_quantization))
    with torch.device("meta"):
        # torch's ops until set_up_backend fills the backend
        model = (Qwen3ForSequenceClassification if config.classifier is not None else Qwen3ForCausalLM)(
            config, KernelBackend(), parallel)
    rank_slices = CheckpointShard(config, parallel.rank, parallel.size) if parallel is not None else None
    tensors = read_checkpoint_tensors(directory, rank_slices)
    visual = None  # Qwen3-VL: the tower apart, the language model's weights under Qwen3's names
    if config.vision is not None:
        visual = take_qwen3_vl_tower(tensors, config, dtype, device, str(directory / "config.json"), model.backend)
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
    set_up_backend(model, rank_config, dtype, device, use_decode_kernel, attention_backend, defer_cpu_kernels,
                   kernel_plan_cache)
    return model, config
