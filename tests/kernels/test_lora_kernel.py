"""The compiled CPU LoRA kernel (kernels/csrc/lora_bf16.cpp) against the torch segmented gather-matmul it stands
for (kernels/lora.py), and the compiled decode stack with adapters in its slots against the LoRA modules run layer
by layer (skipped where the CPU cannot run the kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import slot_table
from model_helpers import CountingStack, PagedSequences, random_tokens

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.lora import LoraGroup, LoraRows, add_lora, lora_groups
from mili_openai.model import KVCache, ModelCaches, load_model
from mili_openai.model.lora_adapter import LoraAdapter
from mili_openai.model.lora_layers import LoraDecodeStack, LoraSlots

pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")

RANK = 8


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fp32 sums in another order may land a value on the other side of a bf16 rounding boundary, rarely
    assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max()))


@pytest.mark.parametrize("in_features, module_outs, rank, row_slots", [
    (64, [48, 16, 16], 8, [2, -1, 0, 2, 2, -1, 1]),  # q, k, v stacked; rows sharing a slot; base rows
    (32, [7, 9], 4, [1, 1, 1]),  # module widths that end mid-vector; one adapter on every row
    (96, [40], 16, [-1, 0]),
])
def test_kernel_matches_the_torch_segmented_matmul(kernels, in_features, module_outs, rank, row_slots):
    table = slot_table(3, in_features, module_outs, rank, seed=in_features)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(len(row_slots), in_features, generator=generator).bfloat16()
    base = torch.randn(len(row_slots), table.offsets[-1], generator=generator).bfloat16()
    rows = LoraRows(lora_groups(row_slots, x.device))
    want = add_lora(base.clone(), x, table, rows)
    got = base.clone()
    assert kernels.supports_lora(x, table)
    assert kernels.add_lora(got, x, table, rows) is got
    assert_matches_reference(got, want)
    assert not torch.equal(got, base)
    assert torch.equal(got[[row for row, slot in enumerate(row_slots) if slot < 0]],
                       base[[row for row, slot in enumerate(row_slots) if slot < 0]])  # base rows untouched


def test_kernel_refuses_a_slot_outside_the_table(kernels):
    table = slot_table(2, 32, [16], 4, seed=0)
    with pytest.raises(RuntimeError, match="slot 2 outside the table"):
        kernels.add_lora(torch.zeros(1, 16).bfloat16(), torch.zeros(1, 32).bfloat16(), table,
                         LoraRows([LoraGroup(2, None)]))


def random_adapter(slots: LoraSlots, seed: int, skip: str | None = None) -> LoraAdapter:
    """An adapter on every projection `slots` took (but `skip`), rank RANK, drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for (layer, module), shape in slots.shapes.items():
        if module != skip:
            weights[(layer, module)] = (torch.randn(RANK, shape.in_features, generator=generator) / 8,
                                        torch.randn(shape.out_features, RANK, generator=generator) / 8)
    return LoraAdapter(f"random-{seed}", Path("."), RANK, weights)


@torch.inference_mode()
def run_with_adapters(model, slots: LoraSlots, slot_of: dict[str, int], pages: PagedSequences, steps,
                      cache: KVCache) -> list:
    results = []
    for decode, prefill in steps:
        batch, rows = pages.batch(decode, prefill)
        with slots.rows(lora_groups([slot_of[key] for key, _ in rows], torch.device("cpu"))):
            hidden = model(batch, ModelCaches(cache))
        results.extend((key, position, row) for (key, position), row in zip(rows, model.compute_logits(hidden)))
    return results


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_moe_checkpoint"])
def test_decode_stack_with_adapters_matches_the_lora_modules(checkpoint, request):
    """Decode steps whose rows run different adapters (and the base) go through the compiled stack, which adds each
    row's slot's delta to every LoRA projection: logits and K/V exactly those of the LoRA modules layer by layer."""
    model, _ = load_model(request.getfixturevalue(checkpoint), torch.bfloat16, torch.device("cpu"))
    stack = model.model.decode_stack
    assert stack is not None
    slots = LoraSlots(model, num_slots=3, max_rank=RANK)
    lora_stack = model.model.decode_stack
    assert isinstance(lora_stack, LoraDecodeStack)
    slots.load(0, random_adapter(slots, seed=1))
    slots.load(2, random_adapter(slots, seed=2, skip="self_attn.k_proj"))  # zeros where an adapter targets nothing
    slot_of = {"a": 0, "b": -1, "c": 2, "d": 0}
    lengths = {"a": 7 + 5, "b": 9 + 5, "c": 4 + 5, "d": 6 + 4}
    tokens = {key: random_tokens(n, seed=20 + i) for i, (key, n) in enumerate(lengths.items())}
    steps = [([], [("a", 7), ("b", 9), ("c", 4), ("d", 6)]), *[(["a", "b", "c", "d"], [])] * 3,
             (["d", "c", "b", "a"], []), (["b", "a"], [])]
    counting = CountingStack(lora_stack)  # proves the first run went through the stack, not the modules both times

    runs = {}
    no_adapters = dict.fromkeys(slot_of, -1)
    for name, decode_stack, row_slots in (("stack", counting, slot_of), ("modules", None, slot_of),
                                          ("base", lora_stack, no_adapters)):
        model.model.decode_stack = decode_stack
        pages = PagedSequences(num_pages=64, page_size=4, seed=6)
        for key, seq in tokens.items():
            pages.add(key, seq)
        cache = KVCache(model.cache_specs(), 64, 4, torch.bfloat16, torch.device("cpu"))
        runs[name] = run_with_adapters(model, slots, row_slots, pages, steps, cache), cache.pools
    model.model.decode_stack = lora_stack
    assert counting.calls == [4, 4, 4, 4, 2]
    (with_stack, stack_pools), (with_modules, module_pools) = runs["stack"], runs["modules"]
    for (key, position, got), (_, _, want) in zip(with_stack, with_modules, strict=True):
        assert torch.equal(got, want), f"{key} position {position}"
    assert torch.equal(stack_pools, module_pools)
    # the adapters move every row on one, and leave the rows on the base alone as the base model runs them
    for (key, position, got), (_, _, base) in zip(with_stack, runs["base"][0], strict=True):
        assert torch.equal(got, base) == (slot_of[key] < 0), f"{key} position {position}"
