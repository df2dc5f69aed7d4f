"""Memory of the hybrid models, against the shapes' arithmetic (docs/models.md's table): Qwen3.5-0.8B's state per
sequence and K/V per token as its cache specs declare them, how many 32K-token sequences a budget holds once the
state pool is set aside, the default number of prefix-cache snapshots, the same split per tensor-parallel rank, and
a runner sizing its two pools from a budget as the arithmetic says."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mili_openai import LLM
from mili_openai.engine.memory_budget import DEFAULT_SNAPSHOT_FRACTION, pages_beside_states, snapshots_in_budget
from mili_openai.model import KVCache, ModelConfig
from mili_openai.model.hybrid_checkpoint import QWEN3_5_0_8B_CONFIG
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.state_cache import StateCache

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
BF16, FP32 = 2, 4  # bytes per value
LONG_CONTEXT = 32 * 1024
PAGE_SIZE = 16


def specs_of(fields: dict, parallel=None) -> list:
    config = ModelConfig.from_dicts({"model_type": "qwen3_5_text", **fields})
    with torch.device("meta"):
        return Qwen3_5ForCausalLM(config, KernelBackend(), parallel).cache_specs()


def test_qwen35_0_8b_state_and_kv_are_the_shapes_arithmetic():
    specs = specs_of(QWEN3_5_0_8B_CONFIG)
    linear_layers, attention_layers = 18, 6  # 6 x (3 Gated DeltaNet + 1 gated attention)
    conv_dim = 2 * 16 * 128 + 16 * 128  # q and k over 16 key heads, v over 16 value heads, of 128
    conv_window = conv_dim * (4 - 1) * BF16  # 36 KiB
    recurrent = 16 * 128 * 128 * FP32  # a (128, 128) fp32 state per value head: 1 MiB
    assert (conv_window, recurrent) == (36 * KIB, MIB)
    assert StateCache.bytes_per_slot(specs, torch.bfloat16) == linear_layers * (conv_window + recurrent)
    kv_per_token = attention_layers * 2 * 2 * 256 * BF16  # K and V of 2 KV heads of 256: 12 KiB
    assert KVCache.bytes_per_page(specs, PAGE_SIZE, torch.bfloat16) == PAGE_SIZE * kv_per_token == PAGE_SIZE * 12 * KIB
    assert LONG_CONTEXT * kv_per_token == 384 * MIB


def test_32k_sequences_in_a_budget():
    """4 GiB for 64 running sequences: the state pool takes 64 x 18.6 MiB first, 2,903.5 MiB of K/V remain, which
    hold seven 32K-token sequences (384 MiB each)."""
    specs = specs_of(QWEN3_5_0_8B_CONFIG)
    slots = 64
    state_bytes = slots * StateCache.bytes_per_slot(specs, torch.bfloat16)
    assert state_bytes == slots * 18 * (36 * KIB + MIB) == 2385 * MIB // 2
    pages = pages_beside_states(4 * GIB, KVCache.bytes_per_page(specs, PAGE_SIZE, torch.bfloat16), state_bytes,
                                "a test budget")
    assert pages * PAGE_SIZE // LONG_CONTEXT == (4 * GIB - state_bytes) // (384 * MIB) == 7


def test_the_default_snapshots_scale_with_the_running_sequences():
    """Qwen3.5-0.8B's 18 MiB + 648 KiB snapshots: 16 sequences get two each where a 4 GiB budget's default share
    (0.2) holds 43; 64 sequences want 128, and get half of what their own 64 slots leave: 77 on 4 GiB, 22 on 2 GiB
    (the 0.2 share: 21); an explicit share or count is taken as given."""
    slot = 18 * MIB + 18 * 36 * KIB
    assert snapshots_in_budget(4 * GIB, slot, None, None, num_running_slots=16) == 43
    assert snapshots_in_budget(4 * GIB, slot, None, None, num_running_slots=32) == 64
    assert snapshots_in_budget(4 * GIB, slot, None, None, num_running_slots=64) == (4 * GIB - 64 * slot) // 2 // slot == 77
    assert snapshots_in_budget(2 * GIB, slot, None, None, num_running_slots=64) == 22
    assert snapshots_in_budget(4 * GIB, slot, 0.1, None, num_running_slots=64) == 21
    assert snapshots_in_budget(4 * GIB, slot, None, 5, num_running_slots=64) == 5


def test_each_tensor_parallel_rank_keeps_half_the_state_and_kv():
    whole, rank = specs_of(QWEN3_5_0_8B_CONFIG), specs_of(QWEN3_5_0_8B_CONFIG, SimpleNamespace(rank=1, size=2))
    assert 2 * StateCache.bytes_per_slot(rank, torch.bfloat16) == StateCache.bytes_per_slot(whole, torch.bfloat16)
    assert 2 * KVCache.bytes_per_page(rank, PAGE_SIZE, torch.bfloat16) == KVCache.bytes_per_page(
        whole, PAGE_SIZE, torch.bfloat16)


def test_the_runner_sizes_both_pools_from_the_budget(hybrid_checkpoint):
    budget_gb, max_seqs = 0.01, 8
    llm = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", page_size=PAGE_SIZE, max_num_seqs=max_seqs,
              kv_cache_memory_gb=budget_gb)
    runner = llm.core.runner
    # the tiny shapes (tests/helpers/hybrid_helpers.py): 3 linear layers of 2 key / 4 value heads of 16, conv 4;
    # one attention layer of 2 KV heads of 32; float32
    state_per_slot = 3 * ((2 * 2 * 16 + 4 * 16) * 3 * FP32 + 4 * 16 * 16 * FP32)
    kv_per_page = PAGE_SIZE * 2 * 2 * 32 * FP32
    assert runner.num_state_slots == llm.core.state_slots.num_slots == max_seqs
    # the state pool: a slot per running sequence, then the prefix cache's snapshots (a fraction of the budget)
    num_snapshots = int(DEFAULT_SNAPSHOT_FRACTION * budget_gb * GIB) // state_per_slot  # more than 2 per sequence
    assert runner.num_state_snapshots == num_snapshots > 0
    slots = max_seqs + num_snapshots
    assert runner.num_pages == (int(budget_gb * GIB) - slots * state_per_slot) // kv_per_page
    stats = llm.core.stats()
    assert (stats.num_pages, stats.num_state_slots) == (runner.num_pages, max_seqs)  # /metrics' two pools
