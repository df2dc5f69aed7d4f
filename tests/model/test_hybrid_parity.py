"""Our Qwen3.5 / Qwen3.5-MoE / Qwen3-Next against transformers' classes (fp32, their torch delta rule) on the same
checkpoints: full prefills, chunked prefills at odd chunk sizes across the delta rule's 64-token chunks, prefill
then decode, several sequences mixed in one batch (decode rows and prefill chunks, each on its own state slot),
and a context past 1,000 tokens. Each with the torch ops and with the compiled CPU kernels' linear attention
(AVX-512, or AVX2 without it) where the CPU has them.

The oracle runs once per layout: one forward over each whole sequence gives the logits of every prefix (the model
is causal), which every schedule below is checked against.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_helpers import hybrid_caches, hybrid_tokens, transformers_class, with_state_slots
from model_helpers import PagedSequences

from mili_openai.kernels.linear_attention import TorchLinearAttention
from mili_openai.model import load_model

FP32_ATOL = 2e-4
LONG = 1100  # past 17 of the delta rule's 64-token chunks and 68 pages of 16
SEQUENCES = {"long": (LONG, 1), "b": (90, 2), "c": (75, 3)}
LAYOUTS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
NUM_PAGES, PAGE_SIZE, NUM_SLOTS = 160, 16, 5


@pytest.fixture(scope="module", params=LAYOUTS)
def reference(request, hybrid_checkpoint):
    """(checkpoint, {sequence: its tokens}, {sequence: transformers' logits at every position}) for a layout."""
    checkpoint = hybrid_checkpoint(request.param)
    hf = transformers_class(request.param).from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    tokens = {key: hybrid_tokens(length, seed) for key, (length, seed) in SEQUENCES.items()}
    with torch.inference_mode():
        logits = {key: hf(torch.tensor([ids])).logits[0].float() for key, ids in tokens.items()}
    return checkpoint, tokens, logits


@pytest.fixture(scope="module", params=["torch ops", "compiled"])
def oracle(request, reference):
    """(our model, tokens, transformers' logits): our model on torch's ops, or on the CPU kernels a default load
    installs (their linear attention: fp32 takes no compiled matmuls)."""
    checkpoint, tokens, logits = reference
    compiled = request.param == "compiled"
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=compiled)
    if compiled and isinstance(model.backend.linear_attention, TorchLinearAttention):
        pytest.skip("no compiled CPU kernels here")
    return model, tokens, logits


@torch.inference_mode()
def run(model, tokens: dict[str, list[int]], steps, slots: dict[str, int]) -> list:
    """Each (decode keys, [(key, n)] prefill chunks) step on fresh caches -> [(key, position, logits row)]."""
    pages = PagedSequences(NUM_PAGES, PAGE_SIZE)
    for key in slots:
        pages.add(key, tokens[key])
    caches = hybrid_caches(model, NUM_PAGES, PAGE_SIZE, NUM_SLOTS)
    results = []
    for decode, prefill in steps:
        batch, rows = pages.batch(decode, prefill)
        logits = model.compute_logits(model(with_state_slots(batch, decode, prefill, slots), caches))
        results.extend((key, position, logits[i]) for i, (key, position) in enumerate(rows))
    return results


def assert_matches(results, expected: dict[str, torch.Tensor]) -> None:
    for key, position, row in results:
        torch.testing.assert_close(row, expected[key][position], rtol=0, atol=FP32_ATOL,
                                   msg=lambda m: f"{key} position {position}: {m}")


def test_full_prefill(oracle):
    model, tokens, logits = oracle
    results = run(model, tokens, [([], [("b", 90)])], {"b": 3})
    assert len(results) == 90
    assert_matches(results, logits)


@pytest.mark.parametrize("chunks", [[37, 1, 30, 22], [63, 2, 25]])
def test_chunked_prefill_at_odd_sizes(oracle, chunks):
    model, tokens, logits = oracle
    results = run(model, tokens, [([], [("b", n)]) for n in chunks], {"b": 1})
    assert [position for _, position, _ in results] == list(range(90))
    assert_matches(results, logits)


def test_prefill_then_decode(oracle):
    model, tokens, logits = oracle
    steps = [([], [("c", 40)])] + [(["c"], [])] * 35
    results = run(model, tokens, steps, {"c": 4})
    assert [position for _, position, _ in results] == list(range(75))
    assert_matches(results, logits)


def test_sequences_mixed_in_one_batch(oracle):
    """Decode rows and prefill chunks of other sequences in the same forwards, each sequence on its own slot:
    a row that read or wrote another's state would drift from the oracle."""
    model, tokens, logits = oracle
    steps = [
        ([], [("b", 20), ("c", 33)]),
        (["b"], [("c", 5), ("long", 70)]),
        (["b", "c"], [("long", 1)]),
        (["c", "long", "b"], []),
        (["long"], [("b", 29)]),
        (["c", "b"], [("long", 9)]),
    ]
    results = run(model, tokens, steps, {"b": 0, "c": 2, "long": 4})
    assert len(results) == 20 + 33 + 1 + 5 + 70 + 2 + 1 + 3 + 1 + 29 + 2 + 9
    assert_matches(results, logits)


def test_long_context_past_many_chunks(oracle):
    """1,100 tokens: chunked prefill over uneven chunks, then decode rows beside another sequence's prefill."""
    model, tokens, logits = oracle
    steps = [([], [("long", n)]) for n in (300, 129, 500, 150)] + [(["long"], [("c", 3)])] * 21
    results = run(model, tokens, steps, {"long": 1, "c": 3})
    assert [position for key, position, _ in results if key == "long"] == list(range(LONG))
    assert_matches(results, logits)
