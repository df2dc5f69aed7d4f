"""LoRA adapters on Qwen3.5, Qwen3.5-MoE and Qwen3-Next against transformers with PEFT's merged adapter (float32,
greedy): PEFT modules on the gated attention, Gated DeltaNet's projections (Qwen3.5's four inputs, Qwen3-Next's two
fused ones), the dense MLP and a sparse layer's shared expert and its gate; two adapters and the base model in the
same steps; and state snapshots (the hybrids' prefix cache) that never serve one adapter's state to another."""

from __future__ import annotations

import pytest

from engine_helpers import assert_matches, greedy
from hybrid_helpers import hybrid_tokens
from lora_helpers import HYBRID_TARGETS, peft_greedy, write_peft_adapter
from mili_openai import LLM

PROMPTS = [hybrid_tokens(length, seed=60 + length) for length in (5, 19, 40)]
SNAPSHOT_PROMPT = hybrid_tokens(40, seed=99)  # run by the snapshot test alone: 40 tokens, a snapshot at 32
MAX_NEW = 6
PAGE_SIZE = 8
ADAPTERS = ("every", "deltanet")


@pytest.fixture(scope="module", params=sorted(HYBRID_TARGETS))
def served(request, hybrid_checkpoint, tmp_path_factory):
    """(an LLM serving two adapters on the layout's checkpoint, {adapter name or None: the oracle per prompt})."""
    checkpoint = hybrid_checkpoint(request.param)
    every, deltanet = HYBRID_TARGETS[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {"every": write_peft_adapter(checkpoint, root / "every", 8, seed=41, targets=every),
                "deltanet": write_peft_adapter(checkpoint, root / "deltanet", 4, seed=42, targets=deltanet)}
    oracle = {name: peft_greedy(checkpoint, adapters.get(name), [*PROMPTS, SNAPSHOT_PROMPT], MAX_NEW)
              for name in (*ADAPTERS, None)}
    llm = LLM(str(checkpoint), dtype="float32", num_pages=256, page_size=PAGE_SIZE, max_num_batched_tokens=512,
              cpu_kernels_in_background=True, lora=dict(modules=list(adapters.items()), max_loras=2, max_lora_rank=8))
    return llm, oracle


def test_two_adapters_and_the_base_in_the_same_steps_match_peft(served):
    llm, oracle = served
    names = [*ADAPTERS, None]
    outputs = llm.generate([prompt for _ in names for prompt in PROMPTS], greedy(MAX_NEW),
                           lora_request=[name for name in names for _ in PROMPTS])
    for index, name in enumerate(names):
        assert_matches(outputs[index * len(PROMPTS) : (index + 1) * len(PROMPTS)], oracle[name][: len(PROMPTS)])
    assert len({tuple(oracle[name][2][0]) for name in names}) == len(names)  # each adapter changes the tokens
    llm.core.check_integrity()


def test_state_snapshots_never_cross_adapters(served):
    """A prompt cached under one adapter resumes from its state snapshot under that adapter only: the base model
    and the other adapter start cold, and every run has its own oracle's tokens."""
    llm, oracle = served
    prompt, expected = SNAPSHOT_PROMPT, {name: rows[-1] for name, rows in oracle.items()}
    first, again = (llm.generate([prompt], greedy(MAX_NEW), lora_request="every")[0] for _ in range(2))
    assert again.num_cached_tokens >= 32
    others = {name: llm.generate([prompt], greedy(MAX_NEW), lora_request=name)[0] for name in ("deltanet", None)}
    assert all(output.num_cached_tokens == 0 for output in others.values())
    assert_matches([first, again], [expected["every"]] * 2)
    for name, output in others.items():
        assert_matches([output], [expected[name]])
    llm.core.check_integrity()
