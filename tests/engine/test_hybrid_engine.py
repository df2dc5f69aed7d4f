"""The engine and Qwen3.5 / Qwen3-Next checkpoints. Until it allocates a state slot per running sequence (the
per-layer cache spec of branch `backend`), it refuses them at start, naming the architecture, rather than
serve them wrongly."""

from __future__ import annotations

import pytest

from mili_openai import LLM


@pytest.mark.parametrize("layout, architecture", [("qwen3_5_vl", "Qwen3_5ForConditionalGeneration"),
                                                  ("qwen3_next", "Qwen3NextForCausalLM")])
def test_hybrid_checkpoints_are_refused_at_start(hybrid_checkpoint, layout, architecture):
    with pytest.raises(NotImplementedError, match=f"{architecture} is not served yet: its linear-attention"):
        LLM(str(hybrid_checkpoint(layout)), dtype="float32")
