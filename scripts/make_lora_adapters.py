"""Random PEFT LoRA adapters for a checkpoint, to benchmark serving many adapters at once (docs/performance.md):

    .venv/bin/python scripts/make_lora_adapters.py CHECKPOINT OUT_DIR                 # 16 adapters of rank 16
    .venv/bin/python scripts/make_lora_adapters.py CHECKPOINT OUT_DIR --count 4 --rank 64 --targets q_proj v_proj

Each adapter is a directory OUT_DIR/lora-<i> in PEFT's format (adapter_config.json, adapter_model.safetensors),
its A and B drawn at random (seed + i) and small enough that the base model's tokens move but stay sensible. The
shapes come from the checkpoint's config.json through the modules mili serves LoRA on (model/lora_targets.py): no
weights are read and no PEFT is needed (16 adapters for Qwen3-0.6B: about a minute on 2 cores, 320 MB). Prints the
`--lora-modules` flags to serve them with, and the names to give `mili bench serve --models`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mili_openai.model import ModelConfig
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SUPPORTED_TARGETS
from mili_openai.model.lora_targets import lora_sites
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model.model.layers"
# B's scale: the delta x A^T B^T is about this fraction of x's size (A is drawn with unit gain over its inputs)
DELTA_SCALE = 0.05
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def module_shapes(checkpoint: Path) -> list[tuple[int, str, int, int]]:
    """(layer, PEFT module path, in features, out features) of every module mili serves LoRA on for `checkpoint`,
    read from its config.json alone (the model is built on the meta device)."""
    config = ModelConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = (Qwen3ForCausalLM if config.hybrid is None else Qwen3_5ForCausalLM)(config, KernelBackend())
    return [(site.layer, module.name, site.in_features, module.out_features)
            for site in lora_sites(model) for module in site.modules]


def make_adapter(shapes: list[tuple[int, str, int, int]], targets: tuple[str, ...], rank: int, seed: int,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One adapter's PEFT tensors on every module whose last name is in `targets`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, module, in_features, out_features in shapes:
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
        b = torch.randn(out_features, rank, generator=generator) * DELTA_SCALE / math.sqrt(rank)
        tensors[f"{PEFT_PREFIX}.{layer}.{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"{PEFT_PREFIX}.{layer}.{module}.lora_B.weight"] = b.to(dtype)
    return tensors


def write_adapters(checkpoint: Path, out_dir: Path, count: int, rank: int, targets: tuple[str, ...], seed: int,
                   dtype: torch.dtype, skip_existing: bool = False) -> list[tuple[str, Path]]:
    """`count` adapters under `out_dir`: [(name, directory)]. skip_existing: keep an adapter already written
    whole (its config, written last, is there)."""
    shapes = module_shapes(checkpoint)
    served = {module.rsplit(".", 1)[-1] for _, module, _, _ in shapes}
    if not set(targets) <= served:
        raise ValueError(f"{checkpoint} serves LoRA on {sorted(served)}, not on {sorted(set(targets) - served)}")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": str(checkpoint)}
    adapters = []
    for index in range(count):
        name, directory = f"lora-{index}", out_dir / f"lora-{index}"
        adapters.append((name, directory))
        if skip_existing and (directory / ADAPTER_CONFIG).is_file():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        save_file(make_adapter(shapes, targets, rank, seed + index, dtype), str(directory / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return adapters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the base model's directory (config.json is read)")
    parser.add_argument("out_dir", type=Path, help="where the adapters' directories go")
    parser.add_argument("--count", type=int, default=16, help="adapters to make")
    parser.add_argument("--rank", type=int, default=16, help="each adapter's rank")
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), choices=SUPPORTED_TARGETS,
                        metavar="MODULE", help=f"PEFT target modules (default: {' '.join(DEFAULT_TARGETS)})")
    parser.add_argument("--seed", type=int, default=0, help="adapter i draws from seed + i")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the saved tensors' dtype")
    args = parser.parse_args(argv)
    if args.count < 1 or args.rank < 1:
        parser.error("--count and --rank must be >= 1")
    adapters = write_adapters(args.checkpoint, args.out_dir, args.count, args.rank, tuple(args.targets), args.seed,
                              DTYPES[args.dtype])
    print("--lora-modules " + " ".join(f"{name}={directory}" for name, directory in adapters))
    print("--models " + ",".join(name for name, _ in adapters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
