"""The Qwen3.5 tokenizer's test data, for the tests of the Qwen3.5 text path (the tokenizer fixtures,
`qwen35_tokenizer` and `qwen35_tokenizer_dir`, are tests/conftest.py's).

- `shared_qwen35()`: `shared/qwen35/` (the test vectors and Qwen3.5's real template): beside the checkout in CI,
  inside it on a device machine, a level further up from a worktree.
"""

from __future__ import annotations

import json
from pathlib import Path

SHARED_SUBDIR = ("shared", "qwen35")


def shared_qwen35() -> Path:
    for parent in Path(__file__).resolve().parents:
        candidate = parent.joinpath(*SHARED_SUBDIR)
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no {'/'.join(SHARED_SUBDIR)} above {Path(__file__).parent}: the Qwen3.5 test data "
                            "lives beside the checkout")


def tokenizer_vectors() -> dict:
    return json.loads((shared_qwen35() / "tokenizer_vectors.json").read_text())


def qwen3_checkpoint_with_qwen35_tokenizer(path: Path) -> Path:
    """A tiny random Qwen3 checkpoint that speaks Qwen3.5's text format: its vocabulary (248,320 embedding rows),
    tokenizer, chat template and end-of-turn ids; for the real engine behind the Qwen3.5 chat path until the
    Qwen3.5 models themselves come with checkpoints of their own."""
    import dataclasses

    import torch

    from mili_openai.model.checkpoint import TINY_SHAPE, TOKENIZER_FILES, build_random_checkpoint
    from mili_openai.model.hybrid_checkpoint import write_qwen35_generation_config_and_tokenizer
    from mili_openai.model.qwen35_tokenizer import EOS_TOKEN_IDS, QWEN35_VOCAB_SIZE

    shape = dataclasses.replace(TINY_SHAPE, vocab_size=QWEN35_VOCAB_SIZE)
    build_random_checkpoint(path, shape, seed=0, dtype=torch.float32)
    for name in TOKENIZER_FILES:  # Qwen3's
        (path / name).unlink()
    write_qwen35_generation_config_and_tokenizer(path)
    config = json.loads((path / "config.json").read_text())
    config.update(bos_token_id=None, eos_token_id=EOS_TOKEN_IDS[0])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
