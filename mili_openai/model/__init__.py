"""Qwen3 in plain torch over a paged KV cache, checkpoint loading, and the embedded default model.

Knows nothing of requests or HTTP: the engine hands it a `ForwardBatch` and its `ModelCaches` (the paged
`KVCache` of the attention layers, the `StateCache` of the linear-attention layers), sized from the model's
`cache_specs()`.
"""

from mili_openai.model.batch import ForwardBatch, PrefillSegment
from mili_openai.model.cache_spec import LayerCacheSpec, ModelCaches, PagedKVSpec, RecurrentStateSpec
from mili_openai.model.checkpoint import QWEN3_0_6B_SHAPE, TINY_SHAPE, ModelShape, build_random_checkpoint
from mili_openai.model.config import ModelConfig, RopeScaling
from mili_openai.model.default_model import (
    HubUnreachableError,
    default_model_path,
    resolve_model_path,
)
from mili_openai.model.kv_cache import KVCache
from mili_openai.model.loader import load_model, resolve_dtype
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.state_cache import StateCache
from mili_openai.model.weights import CheckpointError

__all__ = [
    "QWEN3_0_6B_SHAPE",
    "TINY_SHAPE",
    "CheckpointError",
    "ForwardBatch",
    "HubUnreachableError",
    "KVCache",
    "LayerCacheSpec",
    "ModelCaches",
    "ModelConfig",
    "ModelShape",
    "PagedKVSpec",
    "PrefillSegment",
    "Qwen3ForCausalLM",
    "RecurrentStateSpec",
    "RopeScaling",
    "StateCache",
    "build_random_checkpoint",
    "default_model_path",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
]
