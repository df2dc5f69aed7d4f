"""PEFT LoRA adapters written by PEFT itself on a tiny checkpoint, and the oracle that serves them: transformers'
Qwen3 with the adapter merged by PEFT's `merge_and_unload()`; the targets each hybrid layout takes; random slot tables
for the kernels' tests."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from engine_helpers import hf_greedy
from mili_openai.kernels.lora import LoraSlotTable
from mili_openai.model.lora_adapter import ATTENTION_TARGETS

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DELTANET = {"qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
            "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"]}
MLP = ["gate_proj", "up_proj", "down_proj"]
# layout -> (every module an adapter may target on it, the Gated DeltaNet's alone)
HYBRID_TARGETS = {
    "qwen3_5": (list(ATTENTION_TARGETS) + DELTANET["qwen3_5"] + MLP, DELTANET["qwen3_5"]),
    "qwen3_5_moe": (list(ATTENTION_TARGETS) + DELTANET["qwen3_5"] + MLP + ["shared_expert_gate"], DELTANET["qwen3_5"]),
    # PEFT 0.21 turns gate/up/down_proj on a Qwen3-Next into its routed experts' parameters (target_parameters,
    # which mili refuses) and drops the shared expert's: Qwen3.5-MoE covers the shared expert's MLP
    "qwen3_next": (list(ATTENTION_TARGETS) + DELTANET["qwen3_next"] + ["shared_expert_gate"], DELTANET["qwen3_next"]),
}
# LoRA's A and B both drawn at random (PEFT's init_lora_weights=False), then scaled down so that the delta moves
# the tiny model's tokens without swamping them
WEIGHT_SCALE = 0.5


def load_hf_any(checkpoint: Path):
    """transformers' own class for the checkpoint (Qwen3, Qwen3-MoE), float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def write_peft_adapter(checkpoint: Path, directory: Path, rank: int, seed: int, targets: list[str] | None = None,
                       alpha: float | None = None, use_rslora: bool = False) -> Path:
    """A random PEFT LoRA adapter for `checkpoint`, saved by PEFT's `save_pretrained` into `directory`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets or ALL_TARGETS, use_rslora=use_rslora, init_lora_weights=False)
    with warnings.catch_warnings():  # PEFT calls a transformers method that warns of its own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(load_hf_any(checkpoint), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(WEIGHT_SCALE)
    model.save_pretrained(str(directory))
    return directory


def edit_adapter_config(directory: Path, **fields) -> None:
    """Overwrite fields of an adapter's adapter_config.json (to make one the server must refuse)."""
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def peft_greedy(checkpoint: Path, adapter: Path | None, prompts: list[list[int]], max_new: int):
    """The oracle: greedy tokens and log-softmax rows of transformers' Qwen3 in float32 with `adapter` merged by
    PEFT (None: the base model)."""
    from peft import PeftModel

    model = load_hf_any(checkpoint)
    if adapter is not None:
        with warnings.catch_warnings():  # as in `write_peft_adapter`
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    return [hf_greedy(model, prompt, max_new) for prompt in prompts]


def edited_adapter(source: Path, directory: Path, edit_weights=None, **config_fields) -> Path:
    """A copy of the adapter at `source` in `directory`, its weights passed through `edit_weights` ({name: tensor} ->
    {name: tensor}) and its adapter_config.json fields overwritten by `config_fields`: adapters a server must refuse."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    if edit_weights is not None:
        weights_file = directory / "adapter_model.safetensors"
        save_file(edit_weights(load_file(str(weights_file))), str(weights_file))
    if config_fields:
        edit_adapter_config(directory, **config_fields)
    return directory


def slot_table(num_slots: int, in_features: int, module_outs: list[int], rank: int, seed: int,
               dtype: torch.dtype = torch.bfloat16) -> LoraSlotTable:
    """Random slots (in `dtype`) of a projection stacking `module_outs` modules: B^T block-diagonal, as LoraLinear
    holds it."""
    generator = torch.Generator().manual_seed(seed)
    width, offsets = len(module_outs) * rank, [0]
    lora_a = torch.randn(num_slots, width, in_features, generator=generator) / in_features ** 0.5
    lora_b = torch.zeros(num_slots, width, sum(module_outs))
    for index, out in enumerate(module_outs):
        lora_b[:, index * rank:(index + 1) * rank, offsets[-1]:offsets[-1] + out] = torch.randn(
            num_slots, rank, out, generator=generator)
        offsets.append(offsets[-1] + out)
    return LoraSlotTable(lora_a.to(dtype), lora_b.to(dtype), tuple(offsets))
