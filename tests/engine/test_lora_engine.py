"""LoRA adapters through the engine against transformers with PEFT's merged adapter (float32, greedy): each adapter
alone, four adapters and the base model in one step, slot and host-cache eviction, a prefix cache that never
serves one adapter's K/V to another, and adapters loaded and unloaded at run time."""

from __future__ import annotations

import pytest

from engine_helpers import assert_matches, greedy, random_prompts
from lora_helpers import peft_greedy, write_peft_adapter
from mili_openai import LLM
from mili_openai.engine.contract import LoraAdapterExists, RequestError, UnknownLoraAdapter, check_request
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


def run_step(core) -> list:
    """One step of the engine core, scheduled, run and postprocessed: its deltas."""
    batch, prepared = core.schedule()
    return core.postprocess(batch, core.runner.execute(prepared))


def test_an_adapter_unloaded_mid_generation_finishes_its_sequences(tiny_checkpoint, lora_adapters, oracle):
    """As vLLM: unloading takes the name from new requests; those already on it finish on it (with the oracle's
    tokens), and the adapter's weights go once the last of them ends."""
    llm = lora_llm(tiny_checkpoint, {"r8": lora_adapters["r8"]}, max_loras=1)
    core = llm.core
    core.add(check_request(PROMPTS[1], greedy(MAX_NEW), core.info, lora_name="r8"), "on-r8")
    deltas = run_step(core)  # the prompt's prefill: the sequence runs on r8
    core.lora.unload("r8", core.sequences.values())
    assert core.lora.served_adapters() == () and core.lora.adapter_names(core.scheduler.running) == ("r8",)
    with pytest.raises(UnknownLoraAdapter, match="no LoRA adapter named 'r8'"):
        core.add(check_request(PROMPTS[0], greedy(2), core.info, lora_name="r8"))
    assert core.runner.lora.on_host() == (1,)
    while core.has_work():
        deltas += run_step(core)
    assert [token for delta in deltas for token in delta.token_ids] == oracle["r8"][1][0]
    assert core.runner.lora.on_host() == () and core.lora.names == {}
    core.check_integrity()


def test_an_adapter_loaded_at_run_time_matches_peft_under_a_fresh_id(llm, oracle, lora_adapters):
    """Loaded while others are served, an adapter answers as PEFT's merge; unloaded and loaded again under its name,
    it gets a new id, so K/V cached under the old one is never matched (the prefix cache starts cold)."""
    registry = llm.core.lora
    registry.load("late", str(lora_adapters["attn"]))
    with pytest.raises(LoraAdapterExists):
        registry.load("late", str(lora_adapters["r8"]))
    prompt = PROMPTS[2]
    first, cached = (llm.generate([prompt], greedy(MAX_NEW), lora_request="late")[0] for _ in range(2))
    assert_matches([first, cached], [oracle["attn"][2]] * 2)
    assert cached.num_cached_tokens >= 32
    old_id = registry.id_of("late")
    registry.unload("late", llm.core.sequences.values())
    registry.load("late", str(lora_adapters["attn"]))
    assert registry.id_of("late") > old_id
    reloaded = llm.generate([prompt], greedy(MAX_NEW), lora_request="late")[0]
    assert reloaded.num_cached_tokens == 0
    assert_matches([reloaded], [oracle["attn"][2]])
    registry.unload("late", llm.core.sequences.values())
    llm.core.check_integrity()
