"""LoRA adapters under tensor parallelism (two gloo ranks on CPU, float32): each rank holds its share of every
adapter, cut as its base projection is (model/lora_tensor_parallel.py), and the greedy tokens (and logprobs) of a
mixed batch (several adapters and the base in the same steps) equal one rank's; on Qwen3 with every projection
targeted, and on Qwen3-Next (gated attention, Gated DeltaNet's fused and regrouped inputs, the shared expert's
gate); an adapter loaded at run time reaches every rank before the step that runs it; a bad adapter is refused
before any rank starts; and on every layout the ranks' shares cover each module's rows or input features."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import greedy, random_prompts
from hybrid_helpers import hybrid_tokens
from lora_helpers import HYBRID_TARGETS, write_peft_adapter
from mili_openai import LLM
from mili_openai.model import ModelConfig
from mili_openai.model.lora_adapter import AdapterError
from mili_openai.model.lora_targets import lora_sites
from mili_openai.model.lora_tensor_parallel import shard_lora_sites, whole_model_sites

TP_SIZE = 2
MAX_NEW = 6
# pages of 4 tokens and 32-token steps: prompts prefill in chunks beside decodes
ENGINE_ARGS = dict(dtype="float32", page_size=4, num_pages=128, max_num_batched_tokens=32)


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank, self.size = rank, TP_SIZE


def lora_llm(checkpoint, adapters: dict, size: int, **lora) -> LLM:
    return LLM(str(checkpoint), tensor_parallel_size=size, **ENGINE_ARGS,
               lora=dict(modules=list(adapters.items()), **{"max_loras": len(adapters), "max_lora_rank": 64, **lora}))


def mixed_batch(llm: LLM, prompts: list[list[int]], names: list[str | None]) -> list[tuple[list[int], list]]:
    """Every prompt under every name (None: the base), all in one generate call: (tokens, logprobs) per run."""
    outputs = llm.generate([prompt for _ in names for prompt in prompts], greedy(MAX_NEW),
                           lora_request=[name for name in names for _ in prompts])
    return [(output.outputs[0].token_ids, [entry.logprob for entry in output.outputs[0].logprobs])
            for output in outputs]


def assert_same_runs(got: list, want: list) -> None:
    for (got_tokens, got_logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert got_tokens == want_tokens
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)


def run_both(checkpoint, adapters: dict, prompts: list[list[int]], names: list[str | None],
             during=None) -> tuple[list, list]:
    """The mixed batch on one rank and on TP_SIZE ranks (`during(llm)`: more runs on each, after it)."""
    results = []
    for size in (1, TP_SIZE):
        llm = lora_llm(checkpoint, adapters, size)
        try:
            runs = mixed_batch(llm, prompts, names)
            if during is not None:
                runs += during(llm)
            llm.core.check_integrity()
            results.append(runs)
        finally:
            if size > 1:
                llm.core.runner.close()
    return results[0], results[1]


def test_mixed_adapters_on_two_ranks_match_one_rank(tiny_checkpoint, lora_adapters):
    """r8 and r64 on every projection, rsLoRA on q and v, and the base, in the same steps; then an adapter loaded at
    run time (every rank reads it before the step that names it), and unloaded."""
    adapters = {name: lora_adapters[name] for name in ("r8", "r64", "rslora")}
    prompts = random_prompts(3, [5, 23, 40], seed=11)

    def load_late(llm: LLM) -> list:
        llm.core.lora.load("late", str(lora_adapters["attn"]))
        runs = mixed_batch(llm, prompts[1:], ["late", "r8"])
        llm.core.lora.unload("late", llm.core.sequences.values())
        return runs + mixed_batch(llm, prompts[:1], [None])

    want, got = run_both(tiny_checkpoint, adapters, prompts, [*adapters, None], during=load_late)
    assert_same_runs(got, want)
    assert len({tuple(tokens) for tokens, _ in want[2::3][:4]}) == 4  # each adapter moves the 40-token prompt's tokens


@pytest.mark.parametrize("layout", ["qwen3_next"])  # its fused inputs regrouped, then split (the rest: shares below)
def test_hybrid_adapters_on_two_ranks_match_one_rank(hybrid_checkpoint, tmp_path, layout):
    checkpoint = hybrid_checkpoint(layout)
    every, deltanet = HYBRID_TARGETS[layout]
    adapters = {"every": write_peft_adapter(checkpoint, tmp_path / "every", 8, seed=41, targets=every),
                "deltanet": write_peft_adapter(checkpoint, tmp_path / "deltanet", 4, seed=42, targets=deltanet)}
    prompts = [hybrid_tokens(length, seed=60 + length) for length in (5, 19)]
    want, got = run_both(checkpoint, adapters, prompts, ["every", "deltanet", None])
    assert_same_runs(got, want)


def test_a_bad_adapter_is_refused_before_the_ranks_start(tiny_checkpoint, lora_adapters):
    with pytest.raises(AdapterError, match="'r64'.*rank 64 is over --max-lora-rank 8"):
        lora_llm(tiny_checkpoint, {"r64": lora_adapters["r64"]}, TP_SIZE, max_lora_rank=8)


def rank_sites(config: ModelConfig, rank: int) -> list:
    """The LoRA sites of rank `rank`'s model (built on the meta device, as the loader builds it)."""
    from mili_openai.model.kernel_backend import KernelBackend
    from mili_openai.model.qwen3 import Qwen3ForCausalLM
    from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = (Qwen3_5ForCausalLM if config.hybrid is not None else Qwen3ForCausalLM)(config, KernelBackend(),
                                                                                        _Rank(rank))
    return lora_sites(model)


@pytest.mark.parametrize("layout", ["tiny_checkpoint", "tiny_moe_checkpoint", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_rank_shares_cover_every_module(request, hybrid_checkpoint, layout):
    """Each module's output rows (column-parallel) or input features (row-parallel) over the ranks: every one held
    by some rank (exactly one, but for KV heads replicated over ranks), as many on a rank as its projection holds."""
    checkpoint = request.getfixturevalue(layout) if layout.startswith("tiny") else hybrid_checkpoint(layout)
    config = ModelConfig.from_pretrained(checkpoint)
    whole = whole_model_sites(config)
    shares = [shard_lora_sites(rank_sites(config, rank), whole, config, _Rank(rank)) for rank in range(TP_SIZE)]
    split = {"rows": 0, "columns": 0}
    for index, site in enumerate(whole):
        for position, module in enumerate(site.modules):
            parts = [share[index].modules[position] for share in shares]
            if parts[0].columns is not None:  # row-parallel: the input features split, the rows whole
                split["columns"] += 1
                assert torch.equal(torch.cat([part.columns for part in parts]).sort().values,
                                   torch.arange(site.in_features))
            elif parts[0].row_order is not None and parts[0].out_features < module.out_features:
                split["rows"] += 1
                held = torch.cat([part.row_order for part in parts]).unique()
                assert torch.equal(held, torch.arange(module.out_features))
                if not module.name.endswith(("k_proj", "v_proj")):
                    assert sum(part.out_features for part in parts) == module.out_features
    assert split["rows"] > 0 and split["columns"] > 0
