"""Where the model comes from: the embedded default (a small random Qwen3 built on first use), a local
checkpoint directory, or a Hugging Face hub id."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mili_openai.model.checkpoint import ModelShape, build_random_checkpoint

DEFAULT_CACHE_DIR = Path("~/.cache/mili-openai")
# bump the suffix whenever the shape, seed or writer changes, so old caches are not reused
DEFAULT_MODEL_NAME = "qwen3-random-256h-4l-v1"
DEFAULT_MODEL_SEED = 0
DEFAULT_MODEL_DTYPE = torch.bfloat16  # what real Qwen3 checkpoints ship in; half the disk of float32
DEFAULT_MODEL_SHAPE = ModelShape(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                                 tie_word_embeddings=True)
logger = logging.getLogger(__name__)

HUB_TIMEOUT_S = 5.0  # per metadata request: fail fast where no hub can be reached
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "tokenizer*"]


class HubUnreachableError(ValueError):
    """A hub id was given but the hub could not be reached (and nothing was cached)."""


def default_model_path(cache_dir: str | None = None) -> Path:
    """The embedded default model's checkpoint dir, built on first use.

    Built in a temporary sibling dir and renamed into place: the rename is atomic, so concurrent starts
    either see a complete checkpoint or none, and a loser of the race just discards its copy.
    """
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()
    final = root / DEFAULT_MODEL_NAME
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
    start = time.monotonic()
    logger.info("building the embedded default model in %s (first start only)…", final)
    try:
        build_random_checkpoint(staging, DEFAULT_MODEL_SHAPE, seed=DEFAULT_MODEL_SEED, dtype=DEFAULT_MODEL_DTYPE)
        logger.info("building the embedded default model… done in %.0f s", time.monotonic() - start)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """None -> the default model; an existing directory -> itself; anything else -> a hub id, downloaded."""
    if model is None:
        return default_model_path(cache_dir)
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ValueError(f"model {model!r} is a file; pass a checkpoint directory or a hub id")
    return fetch_from_hub(model)


def fetch_from_hub(repo_id: str) -> Path:
    """Download (or find in the local hub cache) a checkpoint's config, weights and tokenizer files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        # a copy already in the hub cache works offline and needs no network round trip
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
    except HFValidationError as exc:
        raise ValueError(f"model {repo_id!r} is neither a local directory nor a valid hub id: {exc}") from exc
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=HUB_TIMEOUT_S))
    except GatedRepoError as exc:
        raise ValueError(f"model {repo_id!r} is gated on the hub: log in with a token that has access, or pass "
                         "a local checkpoint directory") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(f"model {repo_id!r} is not a local directory and the hub has no such repository") from exc
    except (LocalEntryNotFoundError, OSError) as exc:
        raise HubUnreachableError(
            f"model {repo_id!r} is not a local directory, and the Hugging Face hub could not be reached to "
            f"download it ({type(exc).__name__}). Download the checkpoint elsewhere and pass its local "
            "directory instead, e.g. `mili serve /path/to/Qwen3-0.6B`."
        ) from exc
