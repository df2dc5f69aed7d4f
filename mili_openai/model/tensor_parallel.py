"""How a checkpoint splits over the ranks of a tensor-parallel group (Megatron's layout, as vLLM's):

- column-parallel: q/k/v and gate/up (each expert's too) keep their rows of this rank's heads and
  intermediate slice, so `qkv_proj` and `gate_up_proj` stay fused per rank;
- row-parallel: o_proj and down keep the matching input columns, and each rank's partial output is summed
  by an all-reduce (in the decoder layer);
- KV heads split across ranks, or, with more ranks than KV heads, each is replicated on size / kv ranks;
- the embedding and LM head hold a contiguous slice of the vocabulary, padded to a multiple of the size.

A rank's model is the Qwen3 model built from `shard_config` (its local head counts and sizes), loaded
from the checkpoint slices `CheckpointShard` reads, plus the collectives.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.config import ModelConfig

_ROWS = "rows"
_COLUMNS = "columns"
# checkpoint name (relative to a layer) -> (which slice of the rank's: q heads, kv heads, dense or expert
# intermediate; along rows or columns)
_LAYER_SPLITS = (
    (re.compile(r"\.self_attn\.q_proj\.weight$"), "q", _ROWS),
    (re.compile(r"\.self_attn\.[kv]_proj\.weight$"), "kv", _ROWS),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "q", _COLUMNS),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), "dense", _ROWS),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "dense", _COLUMNS),
    (re.compile(r"\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$"), "expert", _ROWS),
    (re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$"), "expert", _COLUMNS),
)
VOCAB_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


def _has_dense_layers(config: ModelConfig) -> bool:
    return any(not config.is_sparse_layer(i) for i in range(config.num_hidden_layers))


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming what does not split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads})")
    if kv_heads >= size and kv_heads % size or kv_heads < size and size % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}; with more ranks than KV heads, the ranks must be a "
                        "multiple of them)")
    if _has_dense_layers(config) and config.intermediate_size % size:
        problems.append(f"intermediate_size ({config.intermediate_size})")
    if config.moe is not None and config.moe.moe_intermediate_size % size:
        problems.append(f"moe_intermediate_size ({config.moe.moe_intermediate_size})")
    if config.moe is not None and config.moe.shared_expert_intermediate_size % size:
        problems.append(f"shared_expert_intermediate_size ({config.moe.shared_expert_intermediate_size})")
    if config.hybrid is not None and config.hybrid.linear.num_key_heads % size:  # value heads: a multiple of them
        problems.append(f"linear_num_key_heads ({config.hybrid.linear.num_key_heads})")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide this model's {', '.join(problems)}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank holds: its heads, KV heads, intermediate slices and padded vocabulary slice."""
    if size == 1:
        return config
    check_tensor_parallel(config, size)
    moe, hybrid = config.moe, config.hybrid
    if moe is not None:
        moe = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // size,
                                  shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size)
    if hybrid is not None:  # Gated DeltaNet's key and value heads split alike (each rank keeps its GVA groups)
        linear = dataclasses.replace(hybrid.linear, num_key_heads=hybrid.linear.num_key_heads // size,
                                     num_value_heads=hybrid.linear.num_value_heads // size)
        hybrid = dataclasses.replace(hybrid, linear=linear)
    intermediate = config.intermediate_size
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        # an MoE model whose layers are all sparse never builds the dense MLP: its size need not divide
        intermediate_size=intermediate // size if intermediate % size == 0 else intermediate,
        vocab_size=-(-config.vocab_size // size),
        moe=moe,
        hybrid=hybrid,
    )


class CheckpointShard:
    """Reads one rank's slice of each checkpoint tensor, and only that slice, from a safetensors file."""

    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        local = shard_config(config, size)
        head_dim = config.head_dim
        kv_first = rank * config.num_key_value_heads // size  # with replication, size / kv ranks share a head
        moe_rows = local.moe.moe_intermediate_size if local.moe is not None else 0
        self._ranges = {
            "q": (rank * local.num_attention_heads * head_dim, local.num_attention_heads * head_dim),
            "kv": (kv_first * head_dim, local.num_key_value_heads * head_dim),
            "dense": (rank * local.intermediate_size, local.intermediate_size),
            "expert": (rank * moe_rows, moe_rows),
        }
        self._vocab = (rank * local.vocab_size, local.vocab_size, config.vocab_size)

    def read(self, name: str, stored) -> torch.Tensor:
        """`stored`: safetensors' lazy slice of the tensor `name` (indexable, reads only what it returns)."""
        if name in VOCAB_WEIGHTS:
            first, rows, vocab = self._vocab
            part = stored[first : min(first + rows, vocab)]
            return F.pad(part, (0, 0, 0, rows - part.shape[0]))  # the last rank's padding rows are zeros
        for pattern, kind, axis in _LAYER_SPLITS:
            if pattern.search(name):
                first, count = self._ranges[kind]
                return stored[first : first + count] if axis == _ROWS else stored[:, first : first + count]
        return stored[:]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them contributes zeros, and the all-reduce
    assembles each token's row from the rank holding it (exact: every other addend is zero)."""

    def __init__(self, rows: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.first = group.rank * rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first  # (T,)
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        return self.group.all_reduce(hidden.masked_fill_(outside[:, None], 0))
