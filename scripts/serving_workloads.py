"""What `compare_serving.py` runs: its workloads (W1-W3, the multi-turn MT and MT-text) and the random
checkpoints it builds them on (Qwen3-0.6B's shapes, or Qwen3.5-0.8B's)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mili_openai.bench.config import BenchConfig
from mili_openai.bench.prompt_tokens import TOKENIZER_FILE


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    bench: BenchConfig  # base_url/model/EOS fields are filled in per server


# Each workload has its own prompt seed: one server stays up across all of them, and with a shared seed the
# first prompts of two workloads would share their first tokens (and hit mili's prefix cache).
WORKLOADS = (
    Workload("W1", "random prompts: 16 requests, concurrency 8, 256 prompt tokens, 64 output tokens",
             BenchConfig(dataset="random", num_requests=16, concurrency=8, input_len=256, output_len=64,
                         warmup=2, seed=1)),
    Workload("W2", "shared prefix: 16 requests, concurrency 8, 2 groups of ~960 shared + 64 own prompt "
                   "tokens, 32 output tokens",
             BenchConfig(dataset="shared-prefix", num_requests=16, concurrency=8, num_groups=2, prefix_len=960,
                         suffix_len=64, output_len=32, warmup=2, seed=2)),
    Workload("W3", "single stream: 512 prompt tokens, 256 output tokens",
             BenchConfig(dataset="random", num_requests=1, concurrency=1, input_len=512, output_len=256,
                         warmup=1, seed=3)),
    # Multi-turn chat (the prefix cache's workload): every turn resends the history with the server's replies.
    # MT on the chat endpoint, as clients send it (the chat template renders an earlier reply apart from the
    # tokens the model generated, e.g. without Qwen3.5's <think> block, so a server can reuse the history only up
    # to the reply); MT-text on the completions endpoint, the history concatenated as text (what the model saw).
    Workload("MT", "multi-turn chat: 16 conversations at once, 8 turns each, each turn the whole history plus a "
                   "new ~50-token user message, 64 output tokens, chat endpoint",
             BenchConfig(dataset="multi-turn", endpoint="chat", num_conversations=16, num_turns=8, turn_len=50,
                         output_len=64, warmup=2, seed=4)),
    Workload("MT-text", "multi-turn as text: MT's conversations on the completions endpoint, the history "
                        "concatenated",
             BenchConfig(dataset="multi-turn", num_conversations=16, num_turns=8, turn_len=50, output_len=64,
                         warmup=2, seed=5)),
    # A random model's replies are arbitrary token ids, and about half come back as other ids when their text is
    # tokenized again (measured: 11 of 20 random 64-id replies; a median of 44 ids kept), so MT-text's hits stop
    # inside the last reply on every server. MT-ids resends the history as the ids the model saw: what a real model's
    # text history gives, the same ids to every server (mili and vLLM return them under `return_token_ids`,
    # llama.cpp's server under `__verbose.tokens` when asked with `verbose`; both fields are sent).
    Workload("MT-ids", "multi-turn as token ids: MT-text's conversations, the history resent as the ids the model "
                       "saw (prompts as ids, replies as the ids the server returned)",
             BenchConfig(dataset="multi-turn", num_conversations=16, num_turns=8, turn_len=50, output_len=64,
                         warmup=2, seed=5, prompt_as_ids=True)),
)
DEFAULT_WORKLOADS = ("W1", "W2", "W3")  # the multi-turn ones on request: `--workloads W2 MT MT-text`
# The random checkpoints it builds: Qwen3-0.6B's shapes, or Qwen3.5-0.8B's (hybrid: Gated DeltaNet + attention)
MODEL_SHAPES = ("qwen3-0.6b", "qwen3.5-0.8b")


def ensure_checkpoint(path: Path, seed: int, shape: str = MODEL_SHAPES[0]) -> Path:
    """Build the random checkpoint (`shape`, one of MODEL_SHAPES) into a missing or empty dir; refuse to touch an
    incomplete one."""
    if path.exists() and any(path.iterdir()):
        # The builder writes the tokenizer last: without it, or without weights, a build was interrupted.
        if not (path / TOKENIZER_FILE).exists() or not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} holds no complete checkpoint (an interrupted build? delete it)")
        return path
    print(f"building a random {shape}-shaped checkpoint in {path}", file=sys.stderr)
    if shape == "qwen3.5-0.8b":  # with Qwen3.5's own tokenizer and chat template, as llama.cpp's converter wants
        from mili_openai.model.hybrid_checkpoint import (
            QWEN3_5_0_8B_CONFIG,
            QWEN35_TOKENIZER,
            build_random_hybrid_checkpoint,
        )

        return build_random_hybrid_checkpoint(path, "qwen3_5", QWEN3_5_0_8B_CONFIG, seed=seed, dtype=torch.bfloat16,
                                              tokenizer=QWEN35_TOKENIZER)
    from mili_openai.model.checkpoint import QWEN3_0_6B_SHAPE, build_random_checkpoint

    return build_random_checkpoint(path, QWEN3_0_6B_SHAPE, seed=seed, dtype=torch.bfloat16)


def checkpoint_shape(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_num_value_heads", "intermediate_size", "vocab_size", "torch_dtype", "dtype")
    return ", ".join(f"{key} {config[key]}" for key in keys if key in config)
