"""Qwen3-MoE against transformers: the config's sparse/dense layer mix, the router, the grouped experts,
loading per-expert and stacked checkpoints, greedy generation through chunked prefill, prefix reuse and
preemption (fp32), and the per-layer expert load `LLM.expert_load()` reports."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import assert_matches, greedy, hf_greedy, random_prompts
from model_helpers import copy_without_weight, counting_matmul
from mili_openai import LLM
from mili_openai.model import ModelConfig, load_model
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.loader import SINGLE_FILE
from mili_openai.model.moe import SparseMoeBlock

CPU = torch.device("cpu")
MAX_NEW = 8


def load_hf_moe(path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_checkpoint):
    return load_hf_moe(tiny_moe_checkpoint)


# ---- config ----
def moe_config(**overrides) -> dict:
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100,
              "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2}
    return {**config, **overrides}


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_dicts(moe_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [config.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert config.architecture == "Qwen3MoeForCausalLM"
    dense = ModelConfig.from_dicts({**moe_config(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert dense.moe is None and not any(dense.is_sparse_layer(i) for i in range(6))


def test_config_reads_transformers_spelling_and_defaults(tiny_moe_checkpoint):
    written = json.loads((tiny_moe_checkpoint / "config.json").read_text())
    assert "num_local_experts" in written  # transformers 5 renames num_experts when it saves
    moe = ModelConfig.from_pretrained(tiny_moe_checkpoint).moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.mlp_only_layers == (1,)
    bare = {key: value for key, value in moe_config().items() if not key.startswith("num_experts")}
    defaults = ModelConfig.from_dicts(bare).moe  # transformers' Qwen3MoeConfig defaults: Qwen3-30B-A3B's
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size) == (128, 8, 768)
    assert not defaults.norm_topk_prob
    assert ModelConfig.from_dicts(moe_config(num_experts=0)).moe is None  # transformers builds dense MLPs then


@pytest.mark.parametrize(("overrides", "message"), [
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"num_experts_per_tok": 5}, "exceeds num_experts"),
    ({"decoder_sparse_step": -1}, "decoder_sparse_step"),
])
def test_bad_moe_configs_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dicts(moe_config(**overrides))


# ---- the block against transformers' ----
@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_block_matches_transformers(normalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3,
                            norm_topk_prob=normalize)
    config._experts_implementation = "eager"  # transformers' loop over experts: the plainest reference
    generator = torch.Generator().manual_seed(3)
    hf = Qwen3MoeSparseMoeBlock(config)
    for parameter in hf.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
    ours = SparseMoeBlock(32, 6, 3, 16, normalize, KernelBackend())
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(1, 11, 32, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=0, atol=1e-6)
    # every (token, expert) pair counted once
    assert ours.expert_load.sum() == 11 * 3


def test_experts_are_stacked_gate_rows_first(tiny_moe_checkpoint):
    model, _ = load_model(tiny_moe_checkpoint, torch.float32, CPU)
    raw = load_file(str(tiny_moe_checkpoint / SINGLE_FILE))
    experts = model.get_submodule("model.layers.2.mlp.experts")
    for expert in (0, 5):
        prefix = f"model.layers.2.mlp.experts.{expert}"
        torch.testing.assert_close(experts.gate_up_proj[expert], torch.cat(
            [raw[f"{prefix}.gate_proj.weight"], raw[f"{prefix}.up_proj.weight"]]), rtol=0, atol=0)
        torch.testing.assert_close(experts.down_proj[expert], raw[f"{prefix}.down_proj.weight"], rtol=0, atol=0)
    assert isinstance(model.get_submodule("model.layers.1.mlp"), torch.nn.Module)  # layer 1: the dense MLP
    assert not isinstance(model.get_submodule("model.layers.1.mlp"), SparseMoeBlock)


def test_checkpoint_with_stacked_experts_loads_the_same(tmp_path, tiny_moe_checkpoint):
    """transformers 5's in-memory layout (experts already stacked) under the same names loads too."""
    stacked_dir = shutil.copytree(tiny_moe_checkpoint, tmp_path / "stacked")
    tensors = load_file(str(stacked_dir / SINGLE_FILE))
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.{part}_proj.weight") for part in ("gate", "up")])
                   for e in range(8)]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(tensors, str(stacked_dir / SINGLE_FILE), metadata={"format": "pt"})
    want = load_model(tiny_moe_checkpoint, torch.float32, CPU)[0].state_dict()
    got = load_model(stacked_dir, torch.float32, CPU)[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


def test_missing_expert_is_named(tmp_path, tiny_moe_checkpoint):
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    broken = copy_without_weight(tiny_moe_checkpoint, tmp_path / "broken", name)
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight"):
        load_model(broken, torch.float32, CPU)


# ---- the engine against transformers ----
@pytest.mark.parametrize(
    "engine_args",
    [dict(page_size=16, max_num_batched_tokens=4096), dict(page_size=4, max_num_batched_tokens=48)],
    ids=["batched", "chunked"],
)
def test_greedy_matches_transformers(tiny_moe_checkpoint, hf_moe, engine_args):
    prompts = random_prompts(6, [1, 7, 17, 40, 100, 150], seed=1)
    expected = [hf_greedy(hf_moe, p, MAX_NEW) for p in prompts]
    llm = LLM(str(tiny_moe_checkpoint), dtype="float32", num_pages=256, **engine_args)
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)
    llm.core.check_integrity()


def test_prefix_reuse_and_preemption_keep_tokens_exact(tiny_moe_checkpoint, hf_moe):
    system = random_prompts(1, [40], seed=7)[0]
    prompts = [system + tail for tail in random_prompts(5, [5, 9, 16, 23, 30], seed=8)]
    expected = [hf_greedy(hf_moe, p, 20) for p in prompts]
    # 5 sequences of ~80 tokens need ~100 pages of 4: 40 force preemption and recomputation
    llm = LLM(str(tiny_moe_checkpoint), dtype="float32", num_pages=40, page_size=4, max_num_batched_tokens=64)
    first = llm.generate(prompts, greedy(max_tokens=20))
    assert llm.core.stats().num_preemptions_total > 0
    second = llm.generate(prompts, greedy(max_tokens=20))
    assert sum(o.num_cached_tokens for o in second) > 0
    assert_matches(first, expected)
    assert_matches(second, expected)
    llm.core.check_integrity()


def test_expert_load_counts_every_routed_token(tiny_moe_checkpoint, tiny_checkpoint):
    prompt, generated = random_prompts(1, [30], seed=4)[0], 6
    llm = LLM(str(tiny_moe_checkpoint), dtype="float32", num_pages=64, enable_prefix_caching=False)
    llm.generate([prompt], greedy(max_tokens=generated))
    load = llm.expert_load()
    assert sorted(load) == [0, 2]  # the sparse layers; layer 1 is dense
    fed = len(prompt) + generated - 1  # the last sampled token is never fed back
    assert all(len(counts) == 8 and sum(counts) == fed * 2 for counts in load.values())
    assert LLM(str(tiny_checkpoint), dtype="float32", num_pages=16).expert_load() == {}


def test_bf16_through_the_cpu_kernels_stays_close(tiny_moe_checkpoint):
    """bf16 weights route the experts' matmuls and SwiGLU through the compiled kernels where the CPU has
    them; the first token's log-probability stays close to the fp32 oracle's."""
    hf = load_hf_moe(tiny_moe_checkpoint)
    prompts = random_prompts(3, [10, 40, 90], seed=21)
    llm = LLM(str(tiny_moe_checkpoint), dtype="bfloat16", num_pages=64, max_num_batched_tokens=64)
    for output, prompt in zip(llm.generate(prompts, greedy(max_tokens=1)), prompts):
        _, rows = hf_greedy(hf, prompt, 1)
        got = output.outputs[0].logprobs[0]
        assert got.logprob == pytest.approx(float(rows[0][got.token_id]), abs=0.15)


def test_grouped_experts_use_the_model_matmul(tiny_moe_checkpoint):
    """The backend's matmul reaches the experts (the CPU kernels' `linear` on bf16): every expert matmul goes through it."""
    model, _ = load_model(tiny_moe_checkpoint, torch.float32, CPU, use_decode_kernel=False)
    calls = []
    model.backend.matmul = counting_matmul(calls)
    block = model.get_submodule("model.layers.0.mlp")
    with torch.inference_mode():
        block(torch.randn(5, 64))
    hit = int((block.expert_load > 0).sum())
    assert calls.count((64, 64)) == hit and calls.count((64, 32)) == hit  # gate_up (2I, H) and down (H, I)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_experts_through_triton_and_graphs_match_transformers(tiny_moe_checkpoint, hf_moe):
    """On CUDA the experts run in the Triton fused-MoE kernel, inside the captured decode graphs."""
    prompts = random_prompts(4, [7, 40, 100, 150], seed=11)
    expected = [hf_greedy(hf_moe, p, MAX_NEW) for p in prompts]
    llm = LLM(str(tiny_moe_checkpoint), dtype="float32", num_pages=256, device="cuda")
    assert llm.core.runner.forward.decode_graphs is not None
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)
    assert llm.core.runner.forward.decode_graphs.steps_run > 0
