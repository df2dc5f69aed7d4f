"""LoRA under tensor parallelism: each rank holds its share of every adapter, cut as its base projection is cut.

- Column-parallel projections (qkv, gate_up, Gated DeltaNet's in_proj; their output rows split over the ranks): A
  whole, B's rows (B^T's columns) of this rank's output rows only. The rank's delta covers its own rows exactly.
- Row-parallel projections (o_proj, down_proj, out_proj; their input features split): A's columns of this rank's
  input features, B whole. Each rank's delta is partial, like its base output, and is added to that output before
  the decoder layer's all-reduce sums both over the ranks (model/qwen3.py, model/qwen3_5.py).
- Projections every rank holds whole (the shared expert's gate) take the whole adapter.

Which rows and columns a rank holds is read off the checkpoint's own sharding (model/tensor_parallel.py,
model/hybrid_tensor_parallel.py) by passing index vectors through it as if they were weights, so LoRA's slices can
never drift from the base's. Adapters are checked against the whole model's shapes (`whole_model_sites`), which
the engine process uses too, holding no weights itself.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_tensor_parallel import HybridShard
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.lora_targets import LoraModule, LoraSite, lora_sites
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.tensor_parallel import CheckpointShard


def whole_model_sites(config: ModelConfig, model_class: type[nn.Module] | None = None) -> list[LoraSite]:
    """The LoRA sites of the whole (unsharded) model of `config`, built on the meta device (no memory): the shapes
    adapters are made for. `model_class`: the loaded model's class (default: the one the loader builds)."""
    if model_class is None:
        model_class = Qwen3_5ForCausalLM if config.hybrid is not None else Qwen3ForCausalLM
    with torch.device("meta"):
        model = model_class(config, KernelBackend())
    return lora_sites(model)


def shard_lora_sites(sites: list[LoraSite], whole: list[LoraSite], config: ModelConfig,
                     parallel: TensorParallelGroup) -> list[LoraSite]:
    """`sites` (a rank's model's) with each module's rows or columns set to this rank's share of the whole model's
    (`whole`, site for site)."""
    shard = (HybridShard if config.hybrid is not None else CheckpointShard)(config, parallel.rank, parallel.size)
    return [_shard_site(site, whole_site, shard) for site, whole_site in zip(sites, whole, strict=True)]


def _weight_name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{module}.weight"


def _shard_site(site: LoraSite, whole: LoraSite, shard: CheckpointShard | HybridShard) -> LoraSite:
    if site.in_features != whole.in_features:  # row-parallel: this rank's input features, every output row
        modules = tuple(dataclasses.replace(module, columns=shard.read(
            _weight_name(site.layer, module.name), torch.arange(whole.in_features).unsqueeze(0))[0])
            for module in whole.modules)
        local_in = {len(module.columns) for module in modules}
        if local_in != {site.in_features}:
            raise RuntimeError(f"LoRA at layer {site.layer} {site.attribute}: the checkpoint's shard reads "
                               f"{local_in} input features, the projection {site.in_features}")
    else:
        modules = tuple(_module_rows(site.layer, module, shard) for module in whole.modules)
    rows = [module.out_features for module in modules]
    if rows != [module.out_features for module in site.modules]:
        raise RuntimeError(f"LoRA at layer {site.layer} {site.attribute}: the checkpoint's shard holds rows {rows}, "
                           f"the projection {[module.out_features for module in site.modules]}")
    return dataclasses.replace(site, modules=modules)


def _module_rows(layer: int, module: LoraModule, shard: CheckpointShard | HybridShard) -> LoraModule:
    """`module` (the whole model's) with this rank's output rows: each checkpoint part's share, in the part's place
    of the whole projection's rows, then through the module's own row order."""
    shares, first = [], 0
    for name, rows in module.parts or ((module.name, module.out_features),):
        shares.append(shard.read(_weight_name(layer, name), torch.arange(first, first + rows).unsqueeze(1))[:, 0])
        first += rows
    share = torch.cat(shares)
    if share.shape[0] == module.out_features:  # held whole on every rank
        return module
    order = share if module.row_order is None else module.row_order[share]
    return dataclasses.replace(module, out_features=share.shape[0], row_order=order)
