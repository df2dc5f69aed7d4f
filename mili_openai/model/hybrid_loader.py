"""Build a Qwen3.5 / Qwen3.6 / Qwen3-Next model from its checkpoint's tensors (model/loader.py reads them and
sets up the kernels): on the meta device, the hybrid renames (model/hybrid_weights.py), a tensor-parallel rank's
slices (model/hybrid_tensor_parallel.py), the shared name map (model/weights.py), then the weights assigned in
place. What mili does not run yet for these models is refused here, before any weight is placed."""

from __future__ import annotations

import torch

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_tensor_parallel import shard_hybrid_tensors
from mili_openai.model.hybrid_weights import prepare_hybrid_tensors
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.quantization.apply import load_checkpoint_quantization
from mili_openai.model.quantization.spec import CheckpointQuantization
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.tensor_parallel import shard_config
from mili_openai.model.vision_loader import take_vision_tower
from mili_openai.model.weights import CheckpointError, checkpoint_to_model_state


def check_hybrid_options(config: ModelConfig, parallel: TensorParallelGroup | None, quantization: str | None,
                         checkpoint_quantization: CheckpointQuantization | None) -> None:
    """Refuse, naming it, what the hybrid models do not run yet."""
    name = config.architecture
    if parallel is not None and (quantization is not None or checkpoint_quantization is not None):
        raise NotImplementedError(f"{name}: quantized weights run on one rank, not with --tensor-parallel-size > 1")
    if checkpoint_quantization is not None and (config.moe is not None or config.hybrid.linear.fused_projections):
        raise NotImplementedError(f"{name}: pre-quantized checkpoints ({checkpoint_quantization.method}) load for the "
                                  "dense Qwen3.5 / Qwen3.6 layout only, not MoE ones nor Qwen3-Next's fused "
                                  "in_proj_qkvz / in_proj_ba, yet; load the bf16 checkpoint")
    if quantization is not None and config.moe is not None:
        raise NotImplementedError(f"{name}: --quantization {quantization} runs dense models only, not MoE ones, yet")


def build_hybrid_model(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                       device: torch.device, source: str, parallel: TensorParallelGroup | None = None,
                       checkpoint_quantization: CheckpointQuantization | None = None) -> Qwen3_5ForCausalLM:
    """The model in eval mode on `device`, weights (and kept MTP weights) in `dtype`; `tensors` (the whole
    checkpoint's) are consumed. `parallel`: this rank's shard. `checkpoint_quantization`: the projections are
    built as the checkpoint stores them (model/quantization/apply.py), the rest loads dense. `source` names the
    checkpoint in errors. (`--quantization` applies after, as for Qwen3: loader.py.)"""
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config, KernelBackend(), parallel)  # torch's ops until the loader fills it
    tower = config.hybrid.vision_tower  # whole on every rank: it runs before the sharded decoder
    visual = take_vision_tower(tensors, tower, dtype, device, source, model.backend) if tower is not None else None
    mtp, missing = prepare_hybrid_tensors(tensors, config)
    local = config
    if parallel is not None:
        shard_hybrid_tensors(tensors, config, parallel.rank, parallel.size)
        local = shard_config(config, parallel.size)
    placed: dict[str, torch.Tensor] = {}
    if checkpoint_quantization is not None:
        model.quantization = load_checkpoint_quantization(model, tensors, checkpoint_quantization, dtype, device)
        placed = {name: t for name, t in model.state_dict().items() if not t.is_meta}  # quantized modules' own
    tensors = {name: t.to(dtype=dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    state = checkpoint_to_model_state(tensors, local, model.state_dict().keys() - placed.keys(), missing)
    try:
        model.load_state_dict({name: t.to(device) for name, t in state.items()} | placed, strict=True, assign=True)
    except RuntimeError as exc:  # size mismatches: the config and the weights disagree
        raise CheckpointError(f"checkpoint weights do not fit {source}: {exc}") from exc
    if mtp is not None:
        # a quantized checkpoint's MTP projections stay as stored (a cast would drop their scales' meaning)
        model.mtp = mtp.to(device=device) if checkpoint_quantization is not None else mtp.to(device=device, dtype=dtype)
    if visual is not None:
        model.visual = visual
    model.to(device)  # the RoPE buffer and the experts' load counters, built on CPU, follow the weights
    return model.requires_grad_(False).eval()
