"""LoRA adapters through the engine against transformers with PEFT's merged adapter (float32, greedy): each adapter
alone, four adapters and the base model in one step, slot and host-cache eviction, and a prefix cache that never
serves one adapter's K/V to another."""

from __future__ import annotations

import pytest

from engine_helpers import assert_matches, greedy, random_prompts
from lora_helpers import peft_greedy, write_peft_adapter
from mili_openai import LLM
from mili_openai.engine.contract import RequestError
from mili_openai.model.lora_adapter import ATTENTION_TARGETS, AdapterError

PROMPTS = random_prompts(3, [5, 23, 40], seed=11)
MAX_NEW = 6
# cpu_kernels_in_background: where the CPU kernels are not built yet, run on torch's ops rather than wait for them
ENGINE_ARGS = dict(dtype="float32", num_pages=256, page_size=8, max_num_batched_tokens=512,
                   cpu_kernels_in_background=True)
MAX_RANK = 64


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint, lora_adapters):
    """{adapter name (None: the base): the oracle's (tokens, logprob rows) for each of PROMPTS}."""
    names = [*lora_adapters, None]
    return {name: peft_greedy(tiny_checkpoint, lora_adapters.get(name), PROMPTS, MAX_NEW) for name in names}


def lora_llm(checkpoint, adapters, **lora) -> LLM:
    return LLM(str(checkpoint), **ENGINE_ARGS,
               lora=dict(modules=list(adapters.items()), **{"max_lora_rank": MAX_RANK, **lora}))


def record_adapters_per_step(llm: LLM) -> list[int]:
    """How many distinct adapters each step of `llm` runs (the list fills as steps run)."""
    manager, counts = llm.core.runner.lora, []
    groups = manager.groups

    def counting(row_ids, device):
        result = groups(row_ids, device)
        counts.append(len(result))
        return result

    manager.groups = counting
    return counts


@pytest.fixture(scope="module")
def llm(tiny_checkpoint, lora_adapters):
    return lora_llm(tiny_checkpoint, lora_adapters, max_loras=4)


@pytest.mark.parametrize("name", ["r8", "r64", "rslora", "attn", None])
def test_each_adapter_matches_peft(llm, oracle, name):
    assert_matches(llm.generate(PROMPTS, greedy(MAX_NEW), lora_request=name), oracle[name])


def test_four_adapters_and_the_base_in_one_step(llm, oracle):
    names = ["r8", "r64", "rslora", "attn", None]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    per_prompt = [name for name in names for _ in PROMPTS]
    counts = record_adapters_per_step(llm)
    outputs = llm.generate(prompts, greedy(MAX_NEW), lora_request=per_prompt)
    for index, name in enumerate(names):
        assert_matches(outputs[index * len(PROMPTS) : (index + 1) * len(PROMPTS)], oracle[name])
    assert max(counts) == 4  # every adapter's rows (and the base's) ran in the same steps
    llm.core.check_integrity()


def test_prefix_cache_never_crosses_adapters(llm, oracle):
    prompt = PROMPTS[2]  # 40 tokens: 4 full pages of 8 under each adapter after the first run
    first, again = (llm.generate([prompt], greedy(MAX_NEW), lora_request="r8")[0] for _ in range(2))
    assert again.num_cached_tokens >= 32  # the same adapter reuses its own prefix
    other = llm.generate([prompt], greedy(MAX_NEW), lora_request="rslora")[0]
    base = llm.generate([prompt], greedy(MAX_NEW))[0]
    assert_matches([first, again], [oracle["r8"][2]] * 2)
    assert_matches([other], [oracle["rslora"][2]])
    assert_matches([base], [oracle[None][2]])
    llm.core.check_integrity()


def test_one_slot_and_one_host_copy_serve_every_adapter_in_turn(tiny_checkpoint, lora_adapters, oracle):
    """max_loras=1: the scheduler runs one adapter at a time beside the base; max_cpu_loras=1: adapters are read
    from disk again once evicted from the host."""
    llm = lora_llm(tiny_checkpoint, lora_adapters, max_loras=1, max_cpu_loras=1)
    counts = record_adapters_per_step(llm)
    names = ["r8", None, "attn", "r8", "rslora"]
    outputs = llm.generate([PROMPTS[1]] * len(names), greedy(MAX_NEW), lora_request=names)
    for output, name in zip(outputs, names):
        assert_matches([output], [oracle[name][1]])
    assert max(counts) == 1
    llm.core.check_integrity()


def test_unknown_adapter_is_refused(llm):
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
        llm.generate(PROMPTS[:1], greedy(2), lora_request="nope")


def test_adapter_over_the_rank_limit_is_refused_at_start(tiny_checkpoint, lora_adapters):
    with pytest.raises(AdapterError, match="'r64'.*rank 64 is over --max-lora-rank 8"):
        lora_llm(tiny_checkpoint, {"r64": lora_adapters["r64"]}, max_lora_rank=8)


def test_moe_attention_adapter_matches_peft(tiny_moe_checkpoint, tmp_path):
    """Qwen3-MoE: LoRA on every attention projection (PEFT targets the MLP names' expert parameters through
    `target_parameters`, which mili refuses)."""
    adapter = write_peft_adapter(tiny_moe_checkpoint, tmp_path / "moe", 8, seed=31, targets=ATTENTION_TARGETS)
    expected = peft_greedy(tiny_moe_checkpoint, adapter, PROMPTS[:2], MAX_NEW)
    llm = lora_llm(tiny_moe_checkpoint, {"moe": adapter})
    assert_matches(llm.generate(PROMPTS[:2], greedy(MAX_NEW), lora_request="moe"), expected)


def test_hybrid_model_is_refused_at_start(hybrid_checkpoint, lora_adapters):
    with pytest.raises(ValueError, match="Qwen3 and Qwen3-MoE checkpoints only, not on Qwen3_5ForCausalLM"):
        lora_llm(hybrid_checkpoint("qwen3_5"), {"r8": lora_adapters["r8"]})
