"""Where LoRA adapters attach on a loaded model: each projection that takes LoRA, and the PEFT modules it stacks.

PEFT names a module as transformers' model does, by its path in a decoder layer (`self_attn.q_proj`,
`linear_attn.in_proj_qkv`, `mlp.shared_expert.gate_proj`); mili fuses some of them into one projection
(model/weights.py). A `LoraSite` lists, in the projection's output rows' order, each PEFT module it stacks and its
rows. Where a module stores its rows in another order than mili's projection (Qwen3-Next's in_proj_qkvz and
in_proj_ba, interleaved per key head and regrouped at load: model/hybrid_weights.py), the site carries the
permutation that takes the module's rows to mili's, which loading applies to the adapter's B.

Served: Qwen3 and Qwen3-MoE (attention; the dense MLP), Qwen3.5 / Qwen3.6 / Qwen3-Next (gated attention, Gated
DeltaNet's input and output projections, the dense MLP, a sparse layer's shared expert and its gate). A sparse
layer's routed experts take no LoRA: an adapter on them is refused when it is read (model/lora_adapter.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mili_openai.model.gated_attention import QUERY_AND_GATE, GatedAttention
from mili_openai.model.gated_deltanet import GatedDeltaNet
from mili_openai.model.hybrid_config import LinearAttentionConfig
from mili_openai.model.hybrid_weights import regroup_fused_projections
from mili_openai.model.layers import SwiGLUMLP
from mili_openai.model.lora_adapter import TargetShape
from mili_openai.model.moe import SharedExpertMoeBlock
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.tensor_parallel import shard_config

SHARED_EXPERT = "mlp.shared_expert"
SHARED_EXPERT_GATE = "mlp.shared_expert_gate"


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One PEFT module a projection stacks: its path in the decoder layer and its output rows."""

    name: str
    out_features: int
    # the projection's rows as indices into the module's own (Qwen3-Next's fused inputs, a tensor-parallel rank's
    # share); None: all of them, in the same order
    row_order: torch.Tensor | None = None
    # the checkpoint weights (after the hybrid renames) whose rows the projection holds for it, (name, rows) in
    # order, where they are not the module's own (Qwen3-Next's in_proj_qkvz: in_proj_qkv's rows, then in_proj_z's):
    # how a tensor-parallel rank's share of it is found (model/lora_tensor_parallel.py)
    parts: tuple[tuple[str, int], ...] | None = None
    # the input features the projection reads, as indices into the module's (a row-parallel rank's); None: all
    columns: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LoraSite:
    """A projection of decoder layer `layer` that takes LoRA: `parent.<attribute>`, reading `in_features`."""

    layer: int
    parent: nn.Module
    attribute: str
    in_features: int
    modules: tuple[LoraModule, ...]


def lora_sites(model: nn.Module) -> list[LoraSite]:
    """Every projection of `model` that takes LoRA, layer by layer; ValueError for a model that serves none."""
    if isinstance(model, Qwen3ForCausalLM):
        sites = []
        for index, layer in enumerate(model.model.layers):
            attention = layer.self_attn
            sites += _attention_sites(index, attention, attention.q_size, attention.kv_size, model.config.hidden_size)
            sites += _mlp_sites(index, layer.mlp, model.config.hidden_size)
        return sites
    if isinstance(model, Qwen3_5ForCausalLM):  # Gated DeltaNet in this rank's heads
        linear = shard_config(model.config, model.parallel.size if model.parallel is not None else 1).hybrid.linear
        return [site for index, layer in enumerate(model.model.layers) for site in _hybrid_layer_sites(
            index, layer, model.config.hidden_size, linear)]
    raise ValueError(f"LoRA adapters are served on Qwen3, Qwen3-MoE, Qwen3.5 and Qwen3-Next checkpoints only, not on "
                     f"{type(model).__name__}")


def target_shapes(sites: list[LoraSite]) -> dict[tuple[int, str], TargetShape]:
    """What adapters may target on the model of `sites`, by (layer, PEFT module path): each module's (in, out)."""
    return {(site.layer, module.name): TargetShape(site.in_features, module.out_features)
            for site in sites for module in site.modules}


def _hybrid_layer_sites(index: int, layer: nn.Module, hidden: int, linear: LinearAttentionConfig) -> list[LoraSite]:
    if layer.is_linear:
        sites = _linear_attention_sites(index, layer.linear_attn, hidden, linear)
    else:
        attention: GatedAttention = layer.self_attn  # q_proj's rows: each head's query, then its gate
        sites = _attention_sites(index, attention, QUERY_AND_GATE * attention.q_size, attention.kv_size, hidden,
                                 o_in=attention.q_size)
    return sites + _mlp_sites(index, layer.mlp, hidden)


def _attention_sites(index: int, attention: nn.Module, q_rows: int, kv_size: int, hidden: int,
                     o_in: int | None = None) -> list[LoraSite]:
    qkv = (LoraModule("self_attn.q_proj", q_rows), LoraModule("self_attn.k_proj", kv_size),
           LoraModule("self_attn.v_proj", kv_size))
    return [LoraSite(index, attention, "qkv_proj", hidden, qkv),
            LoraSite(index, attention, "o_proj", o_in or q_rows, (LoraModule("self_attn.o_proj", hidden),))]


def _linear_attention_sites(index: int, deltanet: GatedDeltaNet, hidden: int,
                            linear: LinearAttentionConfig) -> list[LoraSite]:
    heads = deltanet.num_v_heads
    if linear.fused_projections:  # Qwen3-Next: in_proj_qkvz then in_proj_ba, each regrouped as the loader does
        qkvz_rows, ba_rows = deltanet.conv_dim + deltanet.value_dim, 2 * heads
        qkv, z, b, a = regroup_fused_projections(torch.arange(qkvz_rows).unsqueeze(1),
                                                 torch.arange(ba_rows).unsqueeze(1), linear)
        qkvz_parts = (("linear_attn.in_proj_qkv", deltanet.conv_dim), ("linear_attn.in_proj_z", deltanet.value_dim))
        inputs = (LoraModule("linear_attn.in_proj_qkvz", qkvz_rows, torch.cat((qkv, z)).squeeze(1), qkvz_parts),
                  LoraModule("linear_attn.in_proj_ba", ba_rows, torch.cat((b, a)).squeeze(1),
                             (("linear_attn.in_proj_b", heads), ("linear_attn.in_proj_a", heads))))
    else:
        inputs = (LoraModule("linear_attn.in_proj_qkv", deltanet.conv_dim),
                  LoraModule("linear_attn.in_proj_z", deltanet.value_dim),
                  LoraModule("linear_attn.in_proj_b", heads), LoraModule("linear_attn.in_proj_a", heads))
    return [LoraSite(index, deltanet, "in_proj", hidden, inputs),
            LoraSite(index, deltanet, "out_proj", deltanet.value_dim, (LoraModule("linear_attn.out_proj", hidden),))]


def _mlp_sites(index: int, mlp: nn.Module, hidden: int) -> list[LoraSite]:
    if isinstance(mlp, SwiGLUMLP):
        return _swiglu_sites(index, mlp, "mlp", hidden)
    if isinstance(mlp, SharedExpertMoeBlock):
        return _swiglu_sites(index, mlp.shared_expert, SHARED_EXPERT, hidden) + [
            LoraSite(index, mlp, "shared_expert_gate", hidden, (LoraModule(SHARED_EXPERT_GATE, 1),))]
    return []  # a sparse block's routed experts take no LoRA


def _swiglu_sites(index: int, mlp: SwiGLUMLP, prefix: str, hidden: int) -> list[LoraSite]:
    size = mlp.intermediate_size
    gate_up = (LoraModule(f"{prefix}.gate_proj", size), LoraModule(f"{prefix}.up_proj", size))
    return [LoraSite(index, mlp, "gate_up_proj", hidden, gate_up),
            LoraSite(index, mlp, "down_proj", size, (LoraModule(f"{prefix}.down_proj", hidden),))]
