"""Tensor parallelism offline: how a checkpoint splits over the ranks, then TP=2 and TP=4 worker groups
(gloo on CPU) giving exactly TP=1's greedy tokens for the dense and the MoE checkpoints, through chunked
prefill, preemption, prefix reuse and prompt scoring; the same expert load; and a dead or failing worker
ending in a clear error rather than a hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import random_prompts
from model_helpers import copy_without_weight
from mili_openai import LLM, SamplingParams
from mili_openai.engine.tp_forward import RunnerFailed
from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.cpu import CpuKernels
from mili_openai.model import KVCache, ModelConfig
from mili_openai.model.cache_spec import PagedKVSpec
from mili_openai.model.loader import SINGLE_FILE, read_checkpoint_tensors
from mili_openai.model.tensor_parallel import CheckpointShard, check_tensor_parallel, shard_config

# pages of 4 tokens and 48-token steps: prompts prefill in chunks beside decodes; 40 pages cannot hold the
# five ~90-token sequences at once, so some are preempted and recomputed
ENGINE_ARGS = dict(dtype="float32", page_size=4, num_pages=40, max_num_batched_tokens=48)
MAX_NEW = 16


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    system = random_prompts(1, [40], seed=30)[0]
    prompts = [system + tail for tail in random_prompts(5, [3, 11, 20, 27, 35], seed=31)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    scored = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1)
    return prompts, [greedy, greedy, scored, greedy, greedy]


def run(llm: LLM) -> list:
    """The workload twice: the second pass finds the shared prefix cached."""
    prompts, params = workload()
    return [llm.generate(prompts, params) for _ in range(2)]


def assert_same_outputs(got: list, want: list) -> None:
    for got_pass, want_pass in zip(got, want, strict=True):
        for got_output, want_output in zip(got_pass, want_pass, strict=True):
            assert got_output.outputs[0].token_ids == want_output.outputs[0].token_ids
            for a, b in zip(got_output.outputs[0].logprobs or [], want_output.outputs[0].logprobs or []):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            for a, b in zip(got_output.prompt_logprobs or [], want_output.prompt_logprobs or []):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.token_id == b.token_id  # (its rank among ~150k near-equal values may move by one)
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert sum(o.num_cached_tokens for o in got[1]) > 0


# ---- the split, in one process ----
def config_for(**fields) -> ModelConfig:
    base = {"model_type": "qwen3", "vocab_size": 1001, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 8}
    return ModelConfig.from_dicts({**base, **fields})


@pytest.mark.parametrize(("fields", "size", "message"), [
    ({}, 5, "num_attention_heads"),
    ({}, 8, "num_attention_heads"),
    ({"num_attention_heads": 24}, 6, "num_key_value_heads"),  # 6 ranks cannot share 4 KV heads evenly
    ({"intermediate_size": 66}, 4, "intermediate_size"),
    ({"model_type": "qwen3_moe", "moe_intermediate_size": 30, "num_experts": 4, "num_experts_per_tok": 1},
     4, "moe_intermediate_size"),
])
def test_sizes_that_do_not_split_are_named(fields, size, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config_for(**fields), size)


def test_rank_shapes():
    local = shard_config(config_for(), 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (3, 1, 16)
    assert local.vocab_size == 251  # 1001 rows padded to 1004 over 4 ranks
    replicated = shard_config(config_for(num_attention_heads=16, num_key_value_heads=2), 8)
    assert (replicated.num_attention_heads, replicated.num_key_value_heads) == (2, 1)
    moe = config_for(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
                     mlp_only_layers=[0], intermediate_size=66)
    with pytest.raises(ValueError, match="intermediate_size"):
        shard_config(moe, 4)  # layer 0 is dense: its MLP must split too


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("checkpoint_name", ["tiny_checkpoint", "tiny_moe_checkpoint"])
def test_rank_slices_reassemble_the_checkpoint(request, checkpoint_name, size):
    checkpoint = request.getfixturevalue(checkpoint_name)
    config = ModelConfig.from_pretrained(checkpoint)
    full = load_file(str(checkpoint / SINGLE_FILE))
    ranks = [read_checkpoint_tensors(checkpoint, CheckpointShard(config, rank, size)) for rank in range(size)]
    q_rows = config.num_attention_heads * config.head_dim
    for name, tensor in full.items():
        parts = [shards[name] for shards in ranks]
        if name.endswith(("k_proj.weight", "v_proj.weight")) and size > config.num_key_value_heads:
            repeat = size // config.num_key_value_heads  # each KV head on `repeat` consecutive ranks
            assert all(torch.equal(parts[r], parts[r - r % repeat]) for r in range(size))
            parts = parts[::repeat]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            joined = torch.cat(parts)
            assert torch.equal(joined[: tensor.shape[0]], tensor) and not joined[tensor.shape[0]:].any()
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif parts[0].shape == tensor.shape:
            assert all(torch.equal(part, tensor) for part in parts), name  # replicated
        else:
            assert torch.equal(torch.cat(parts), tensor), name
    assert ranks[1]["model.layers.0.self_attn.q_proj.weight"].shape[0] == q_rows // size


def test_size_that_does_not_split_fails_before_spawning(tiny_checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide .* num_attention_heads"):
        LLM(str(tiny_checkpoint), tensor_parallel_size=3, **ENGINE_ARGS)


# ---- worker groups ----
@pytest.fixture(scope="module", params=["tiny_checkpoint", "tiny_moe_checkpoint"])
def checkpoint_and_reference(request):
    checkpoint = request.getfixturevalue(request.param)
    single = LLM(str(checkpoint), **ENGINE_ARGS)
    outputs = run(single)
    assert single.core.stats().num_preemptions_total > 0
    return checkpoint, outputs, single.expert_load()


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_matches_one_rank(checkpoint_and_reference, size):
    checkpoint, want, want_load = checkpoint_and_reference
    llm = LLM(str(checkpoint), tensor_parallel_size=size, **ENGINE_ARGS)
    try:
        got = run(llm)
        assert llm.core.stats().num_preemptions_total > 0
        assert_same_outputs(got, want)
        assert llm.expert_load() == want_load  # every rank routed every token as one rank did
        llm.core.check_integrity()
    finally:
        llm.core.runner.close()


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
def test_bf16_moe_on_the_cpu_kernels_matches_one_rank(tiny_moe_checkpoint):
    """bf16 on CPU: each of two ranks holds half of every expert's intermediate columns, whole vectors, so its
    sparse blocks run the compiled MoE kernel (prefill chunks, and the decode stack) and its partial sums meet
    in the all-reduce; the greedy tokens are TP=1's, whose kernel holds whole experts. Deterministic: the
    kernels' sums do not depend on the threads, and two ranks' all-reduce adds the same two values."""
    rank_config = shard_config(ModelConfig.from_pretrained(tiny_moe_checkpoint), 2)
    rank_gate_up = torch.empty(rank_config.moe.num_experts, 2 * rank_config.moe.moe_intermediate_size,
                               rank_config.hidden_size, dtype=torch.bfloat16)
    assert CpuKernels.supports_sparse_moe(torch.empty(1, rank_config.hidden_size, dtype=torch.bfloat16),
                                          rank_gate_up)
    args = dict(dtype="bfloat16", page_size=4, num_pages=64, max_num_batched_tokens=48)
    prompts = random_prompts(3, [9, 30, 70], seed=41)  # 70 tokens: a prompt in two chunks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(str(tiny_moe_checkpoint), **args)
    want = single.generate(prompts, params)
    llm = LLM(str(tiny_moe_checkpoint), tensor_parallel_size=2, **args)
    try:
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        # every token routed in every sparse layer; which experts may differ where a bf16 partial sum rounds
        # otherwise than the whole one (a near tie in the router), without changing a greedy token
        got_load, want_load = llm.expert_load(), single.expert_load()
        assert {layer: sum(load) for layer, load in got_load.items()} == \
            {layer: sum(load) for layer, load in want_load.items()}
    finally:
        llm.core.runner.close()


def test_dead_worker_is_a_clear_error_not_a_hang(tiny_checkpoint):
    budget_gb = 0.01  # the ranks size their pools from it: per rank, in their own KV heads
    args = {**ENGINE_ARGS, "num_pages": None, "kv_cache_memory_gb": budget_gb}
    llm = LLM(str(tiny_checkpoint), tensor_parallel_size=2, **args)
    rank_config = shard_config(ModelConfig.from_pretrained(tiny_checkpoint), 2)
    specs = [PagedKVSpec(rank_config.num_key_value_heads, rank_config.head_dim)] * rank_config.num_hidden_layers
    per_page = KVCache.bytes_per_page(specs, ENGINE_ARGS["page_size"], torch.float32)
    assert llm.core.runner.num_pages == int(budget_gb * (1 << 30)) // per_page
    workers = llm.core.runner.forward.workers
    prompt = random_prompts(1, [20], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([prompt], params)[0].outputs[0].token_ids) == 4
    pid = workers.pids[1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RunnerFailed, match=rf"tensor-parallel rank 1 \(pid {pid}\) was killed by signal 9 "):
        llm.generate([prompt], params)
    assert llm.core.runner.failure is not None
    with pytest.raises(RunnerFailed):  # and stays failed
        llm.generate([prompt], params)
    assert not any(worker_alive(p) for p in workers.pids)  # the survivor was stopped too


def worker_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_that_cannot_load_reports_why(tmp_path, tiny_checkpoint):
    broken = copy_without_weight(tiny_checkpoint, tmp_path / "broken", "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(RunnerFailed, match=r"rank \d failed:(.|\n)*missing weights: model\.layers\.1\.mlp\.up_proj"):
        LLM(str(broken), tensor_parallel_size=2, **ENGINE_ARGS)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_tensor_parallel_with_graphs_matches_one_gpu(tiny_moe_checkpoint):
    """NCCL collectives inside the captured decode graphs; the experts through the Triton kernel."""
    args = dict(dtype="float32", page_size=16, num_pages=64, device="cuda")
    prompts, params = workload()
    want = LLM(str(tiny_moe_checkpoint), **args).generate(prompts, params)
    llm = LLM(str(tiny_moe_checkpoint), tensor_parallel_size=2, **args)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    llm.core.runner.close()
