"""Where the model comes from: an embedded model (a small random Qwen3, the default, or a small random Qwen3.5,
built on first use), a local checkpoint directory, or a Hugging Face hub id."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mili_openai.model.checkpoint import ModelShape, build_random_checkpoint
from mili_openai.model.hybrid_checkpoint import QWEN35_TOKENIZER, build_random_hybrid_checkpoint
from mili_openai.model.qwen35_tokenizer import QWEN35_VOCAB_SIZE

DEFAULT_CACHE_DIR = Path("~/.cache/mili-openai")
# bump the suffix whenever the shape, seed or writer changes, so old caches are not reused
DEFAULT_MODEL_NAME = "qwen3-random-256h-4l-v1"
DEFAULT_MODEL_SEED = 0
DEFAULT_MODEL_DTYPE = torch.bfloat16  # what real Qwen3 checkpoints ship in; half the disk of float32
DEFAULT_MODEL_SHAPE = ModelShape(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                                 tie_word_embeddings=True)
# `mili serve NAME` for these names builds (once) and serves the embedded model, with no download
TINY_QWEN3_NAME = "mili-tiny-random-qwen3"
TINY_QWEN35_NAME = "mili-tiny-random-qwen3.5"
TINY_QWEN35_DIR_NAME = "qwen3.5-random-256h-4l-v1"  # versioned as DEFAULT_MODEL_NAME
# Qwen3.5-0.8B's layout shrunk: 3 Gated DeltaNet layers (2 key heads over 4 value heads of 64: GVA) and one gated
# attention layer (4 query / 2 KV heads of 64, 16 rotary dims as mRoPE sections 3 + 3 + 2 pairs), Qwen3.5's whole
# vocabulary (its tokenizer's ids), a tied LM head, one MTP layer; every head count splits over 2 ranks
TINY_QWEN35_CONFIG = dict(
    vocab_size=QWEN35_VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=32768,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[3, 3, 2],
                         mrope_interleaved=True),
    mtp_num_hidden_layers=1)
logger = logging.getLogger(__name__)

HUB_TIMEOUT_S = 5.0  # per metadata request: fail fast where no hub can be reached
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "tokenizer*", "chat_template.jinja"]


class HubUnreachableError(ValueError):
    """A hub id was given but the hub could not be reached (and nothing was cached)."""


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A random-weight model mili builds itself, under a name `mili serve` takes instead of a path."""

    name: str  # what clients and `mili serve` call it
    directory: str  # its versioned directory in the cache
    build: Callable[[Path], object]  # writes the checkpoint into an empty directory


def _build_tiny_qwen3(directory: Path) -> None:
    build_random_checkpoint(directory, DEFAULT_MODEL_SHAPE, seed=DEFAULT_MODEL_SEED, dtype=DEFAULT_MODEL_DTYPE)


def _build_tiny_qwen35(directory: Path) -> None:
    build_random_hybrid_checkpoint(directory, "qwen3_5", TINY_QWEN35_CONFIG, seed=DEFAULT_MODEL_SEED,
                                   dtype=DEFAULT_MODEL_DTYPE, tokenizer=QWEN35_TOKENIZER)


EMBEDDED_MODELS = (EmbeddedModel(TINY_QWEN3_NAME, DEFAULT_MODEL_NAME, _build_tiny_qwen3),
                   EmbeddedModel(TINY_QWEN35_NAME, TINY_QWEN35_DIR_NAME, _build_tiny_qwen35))


def embedded_model(name: str | None) -> EmbeddedModel | None:
    """The embedded model `name` calls for (None: the default one); None for any other name."""
    if name is None:
        return EMBEDDED_MODELS[0]
    return next((model for model in EMBEDDED_MODELS if model.name == name), None)


def default_model_path(cache_dir: str | None = None, name: str | None = None) -> Path:
    """The embedded model's checkpoint dir (`name`: one of EMBEDDED_MODELS' names; None: the default), built on
    first use.

    Built in a temporary sibling dir and renamed into place: the rename is atomic, so concurrent starts
    either see a complete checkpoint or none, and a loser of the race just discards its copy.
    """
    model = embedded_model(name)
    if model is None:
        raise ValueError(f"no embedded model is called {name!r}: {[m.name for m in EMBEDDED_MODELS]}")
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()
    final = root / model.directory
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.directory}-", dir=root))
    start = time.monotonic()
    logger.info("building the embedded model %s in %s (first start only)…", model.name, final)
    try:
        model.build(staging)
        logger.info("building the embedded model %s… done in %.0f s", model.name, time.monotonic() - start)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """None -> the default model; an existing directory -> itself; an embedded model's name -> that model; anything
    else -> a hub id, downloaded."""
    if model is None:
        return default_model_path(cache_dir)
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if embedded_model(model) is not None:
        return default_model_path(cache_dir, model)
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
