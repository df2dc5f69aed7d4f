"""How a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint splits over the ranks of a tensor-parallel group, beside what
it shares with Qwen3 (model/tensor_parallel.py: KV heads, o_proj, the MLPs and experts, the vocabulary).

- Gated DeltaNet: each rank keeps a contiguous block of key heads and the value heads they serve (GVA groups
  stay whole: value head h reads key head h // (Hv / Hk)). Column-parallel: in_proj_qkv's and the conv's q, k
  and v channels of those heads, in_proj_z's value rows, in_proj_b / in_proj_a / A_log / dt_bias per value
  head; the gated RMSNorm normalises each head on its own, so its weight is whole on every rank. Row-parallel:
  out_proj's columns of those value heads, summed over the ranks. Each rank's state pool holds its heads only.
- Gated attention: q_proj's rows come per head as [query; gate], so a rank keeps twice Qwen3's query rows.
- The shared expert splits like a dense MLP; its sigmoid gate (one row) and the router stay whole.
- Experts stored stacked (E, 2I, H) / (E, H, I) split their gate and up halves alike.

The slices are taken after the hybrid renames (model/hybrid_weights.py), so both generations' layouts split
the same way. Each rank reads the whole checkpoint, then keeps its slices (copies: the rest is freed); the
multi-token-prediction weights stay whole.
"""

from __future__ import annotations

import torch

from mili_openai.model.config import ModelConfig
from mili_openai.model.gated_attention import QUERY_AND_GATE
from mili_openai.model.tensor_parallel import CheckpointShard, shard_config

CONV_CHANNELS = ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")  # [q; k; v] channels
VALUE_ROWS = ("linear_attn.in_proj_z.weight",)
PER_VALUE_HEAD = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log",
                  "linear_attn.dt_bias")
OUT_PROJ = "linear_attn.out_proj.weight"
GATED_QUERY = "self_attn.q_proj.weight"
SHARED_EXPERT_ROWS = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
SHARED_EXPERT_COLUMNS = "mlp.shared_expert.down_proj.weight"
STACKED_GATE_UP = "mlp.experts.gate_up_proj"
STACKED_DOWN = "mlp.experts.down_proj"


class HybridShard:
    """One rank's slices of a hybrid checkpoint's (renamed) tensors."""

    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        local, linear = shard_config(config, size), config.hybrid.linear
        key_heads, value_heads = local.hybrid.linear.num_key_heads, local.hybrid.linear.num_value_heads
        self.qwen3 = CheckpointShard(config, rank, size)
        self.split = (linear.key_dim, linear.key_dim, linear.value_dim)  # the [q; k; v] channels
        self.key = slice(rank * key_heads * linear.key_head_dim, (rank + 1) * key_heads * linear.key_head_dim)
        self.value = slice(rank * value_heads * linear.value_head_dim,
                           (rank + 1) * value_heads * linear.value_head_dim)
        self.value_heads = slice(rank * value_heads, (rank + 1) * value_heads)
        query_rows = QUERY_AND_GATE * local.num_attention_heads * config.head_dim
        self.query = slice(rank * query_rows, (rank + 1) * query_rows)
        moe = local.moe
        shared = moe.shared_expert_intermediate_size if moe is not None else 0
        self.shared = slice(rank * shared, (rank + 1) * shared)
        experts = moe.moe_intermediate_size if moe is not None else 0
        self.expert = slice(rank * experts, (rank + 1) * experts)
        self.expert_size = experts * size

    def read(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name`, a copy of its own."""
        if name.endswith(CONV_CHANNELS):
            q, k, v = tensor.split(self.split)
            return torch.cat((q[self.key], k[self.key], v[self.value]))
        if name.endswith(VALUE_ROWS):
            return tensor[self.value].clone()
        if name.endswith(PER_VALUE_HEAD):
            return tensor[self.value_heads].clone()
        if name.endswith(OUT_PROJ):
            return tensor[:, self.value].clone()
        if name.endswith(GATED_QUERY):
            return tensor[self.query].clone()
        if name.endswith(SHARED_EXPERT_ROWS):
            return tensor[self.shared].clone()
        if name.endswith(SHARED_EXPERT_COLUMNS):
            return tensor[:, self.shared].clone()
        if name.endswith(STACKED_GATE_UP):  # (E, 2I, H): gate rows, then up rows
            gate, up = tensor.split(self.expert_size, dim=1)
            return torch.cat((gate[:, self.expert], up[:, self.expert]), dim=1)
        if name.endswith(STACKED_DOWN):  # (E, H, I)
            return tensor[:, :, self.expert].clone()
        return self.qwen3.read(name, tensor).clone()


def shard_hybrid_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> None:
    """Replace each tensor (in place) by rank `rank`'s slice of it, of `size` ranks."""
    shard = HybridShard(config, rank, size)
    for name in list(tensors):
        tensors[name] = shard.read(name, tensors.pop(name))
