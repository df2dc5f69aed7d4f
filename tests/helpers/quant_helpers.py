"""Shared by the quantization tests: a model shape int4 takes (rows of multiples of 128), checkpoints in the
AWQ, GPTQ, FP8 and compressed-tensors layouts written from a dense one, and dense checkpoints of dequantized
weights for the transformers oracle; and steps of prefill chunks and decode rows run straight through a model.

The packing here is written from the formats' descriptions (AutoAWQ's GEMM packer, GPTQ's row packing,
DeepSeek-style FP8 blocks, compressed-tensors' pack_to_int32 and naive compressors), independently of the
loader's unpacking, so a loader that reads the layouts wrongly fails the tests.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine_helpers import hf_greedy, load_hf, random_prompts
from model_helpers import PagedSequences, random_tokens

from mili_openai.kernels.fp8 import dequantize_fp8
from mili_openai.kernels.quantized import dequantize
from mili_openai.model import KVCache, ModelCaches
from mili_openai.model.checkpoint import ModelShape
from mili_openai.model.quantization.modules import Fp8Linear, QuantizedLinear

# A 5,120-token vocabulary under Qwen3's tokenizer for the offline engine (`LLM`): Qwen3's 151,936 rows made the
# quantized embedding and LM head, their dequantized copies and the oracle most of these tests' time. The LM head
# still spans two whole GEMM slices and a part one (kernels/quantized.py: GEMM_SLICE_BYTES / (128 * 2 bytes) =
# 2,048 rows), and is whole FP8 blocks and AWQ packs. SERVED_SHAPE keeps Qwen3's vocabulary, for the tests that
# start an `AsyncEngine`: its structured-output grammar (llguidance) refuses a vocabulary below the tokenizer's.
QUANT_VOCAB = 5120
SERVED_SHAPE = ModelShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32)
QUANT_SHAPE = dataclasses.replace(SERVED_SHAPE, vocab_size=QUANT_VOCAB)
UNTIED_SHAPE = ModelShape(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0,
                          vocab_size=QUANT_VOCAB)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ puts column AWQ_ORDER[i] of each eight in nibble i
FP8_MAX = 448.0
PROMPT_LENGTHS = [1, 9, 40, 130]
MAX_NEW = 8
BF16_ERROR_RATIO = 1.5  # our bf16 error vs the float32 oracle, relative to transformers' own bf16 error
CPU = torch.device("cpu")


def oracle_tokens(reference) -> tuple[list[list[int]], list]:
    """Prompts and transformers' greedy continuations of them on the checkpoint at `reference`."""
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11, vocab=QUANT_VOCAB)
    hf = load_hf(reference)
    return prompts, [hf_greedy(hf, prompt, MAX_NEW) for prompt in prompts]


def decode_schedule() -> tuple[dict[str, list[int]], list]:
    """Three sequences' tokens and the steps that run them: prefill chunks beside decode rows, then decodes."""
    lengths = {"a": 14, "b": 30, "c": 12}
    tokens = {key: random_tokens(n, seed=20 + i, vocab=QUANT_VOCAB) for i, (key, n) in enumerate(lengths.items())}
    steps = [([], [("a", 6), ("b", 20)]), (["a", "b"], [("c", 5)]), (["a", "b", "c"], []), (["c", "a", "b"], []),
             (["a", "b"], [("c", 2)]), (["a", "b", "c"], []), (["b"], [])]
    return tokens, steps


@torch.inference_mode()
def run_steps(model, config, tokens, steps, seed: int) -> tuple[list, torch.Tensor]:
    """`steps` through `model` on shuffled pages -> ([(key, position, logits row)], the K/V pools)."""
    pages = PagedSequences(num_pages=64, page_size=4, seed=seed)
    for key, seq in tokens.items():
        pages.add(key, seq)
    cache = KVCache(model.cache_specs(), 64, 4, model.dtype, CPU)
    rows = []
    for decode, prefill in steps:
        batch, keys = pages.batch(decode, prefill)
        logits = model.compute_logits(model(batch, ModelCaches(cache))[batch.logits_indices])
        rows.extend((key, position, logits[i]) for i, (key, position) in enumerate(keys))
    return rows, cache.pools


def assert_as_close_as_transformers_bf16(model, config, hf32, hf16) -> None:
    """`model`'s bf16 logits through `decode_schedule` are as close to the float32 oracle `hf32` as `hf16`'s
    (transformers in bf16 on the same weights) are, within BF16_ERROR_RATIO."""
    tokens, steps = decode_schedule()
    rows, _ = run_steps(model, config, tokens, steps, seed=2)
    with torch.inference_mode():
        oracle = {key: hf32(torch.tensor([seq])).logits[0].float() for key, seq in tokens.items()}
        hf_error = max(float((hf16(torch.tensor([seq])).logits[0].float() - oracle[key]).abs().max())
                       for key, seq in tokens.items())
    our_error = max(float((row - oracle[key][position]).abs().max()) for key, position, row in rows)
    assert our_error <= BF16_ERROR_RATIO * hf_error


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def write_checkpoint(source: Path, target: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """`source`'s config, tokenizer and generation config, with `tensors` as the weights."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    return target


def quantize_groups(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """(N, K) -> levels (N, K), float16 scales (N, G), zeros (N, G): min/max quantization per group."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.float().view(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / (top // 2)).half().float().clamp(min=1e-8)
        zero = torch.full_like(scale, float((top + 1) // 2))
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / top).half().float().clamp(min=1e-8)
        zero = torch.round(-low / scale).clamp(1, top)  # GPTQ v1 cannot store a zero point of 0
    levels = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, top)
    return levels.view(n, k).long(), scale.half(), zero.long()


def dequantized(levels, scales, zeros, group: int) -> torch.Tensor:
    rep = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    return (levels.float() - rep(zeros)) * rep(scales)


def pack_fields(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Consecutive values along `dim` into int32s, value i of each in bits i*bits upward."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    packed = (v << (torch.arange(per) * bits)).sum(-1)
    return packed.to(torch.int32).movedim(-1, dim)  # wraps past 2^31 as the int32 the formats store


def awq_tensors(prefix: str, w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    levels, scales, zeros = quantize_groups(w, 4, group, symmetric=False)

    def pack(values: torch.Tensor) -> torch.Tensor:  # (R, C) -> (R, C / 8), AutoAWQ's column order
        rows, cols = values.shape
        order = values.view(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
        return pack_fields(order.reshape(rows, cols), 4, 1)

    tensors = {f"{prefix}.qweight": pack(levels.t()), f"{prefix}.qzeros": pack(zeros.t()),
               f"{prefix}.scales": scales.t()}
    return tensors, dequantized(levels, scales, zeros, group)


def gptq_tensors(prefix: str, w: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                 stored_zero_offset: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    k = w.shape[1]
    levels, scales, zeros = quantize_groups(w, bits, group or k, symmetric)
    tensors = {f"{prefix}.qweight": pack_fields(levels.t(), bits, 0),  # (K * bits / 32, N): rows packed
               f"{prefix}.qzeros": pack_fields((zeros - stored_zero_offset).t() & ((1 << bits) - 1), bits, 1),
               f"{prefix}.scales": scales.t(),
               f"{prefix}.g_idx": (torch.arange(k) // (group or k)).to(torch.int32)}
    return tensors, dequantized(levels, scales, zeros, group or k)


def fp8_tensors(prefix: str, w: torch.Tensor, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # (rows, cols)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale}, q.float() * full


def compressed_int_tensors(prefix: str, w: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                           fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors int weights: signed values stored offset by 2^(bits-1), packed along K into int32s
    (pack-quantized) or kept as int8; bf16 scales (the model's dtype); zero points packed along N."""
    n, k = w.shape
    levels, scales, zeros = quantize_groups(w, bits, group or k, symmetric)  # levels: q + 2^(bits-1)
    scales = scales.to(torch.bfloat16)
    offset = 1 << (bits - 1)
    if fmt == "pack-quantized":
        tensors = {f"{prefix}.weight_packed": pack_fields(levels, bits, 1),
                   f"{prefix}.weight_shape": torch.tensor([n, k])}
    else:
        tensors = {f"{prefix}.weight": (levels - offset).to(torch.int8)}
    tensors[f"{prefix}.weight_scale"] = scales
    if not symmetric:
        tensors[f"{prefix}.weight_zero_point"] = (pack_fields(zeros, bits, 0) if fmt == "pack-quantized"
                                                  else (zeros - offset).to(torch.int8))
    return tensors, dequantized(levels, scales, zeros, group or k)


def compressed_fp8_tensors(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors FP8-dynamic weights: e4m3 with a bf16 scale per row (N, 1)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).bfloat16()
    q = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, q.float() * scale.float()


def compressed_config(fmt: str, weights: dict, input_activations: dict | None = None,
                      ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """A quantization_config as llm-compressor writes it: one config group over every Linear module."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"dynamic": False, **weights},
                                          "input_activations": input_activations, "output_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def library_compress(w: torch.Tensor, fmt: str, weights: dict, activations: dict | None,
                     extra: dict[str, torch.Tensor] | None = None):
    """`w` compressed by compressed-tensors' own compressor for `fmt` -> (its tensors, its decompressed float32
    weight: the stored values times float32 scales). `extra`: more of the module's state (e.g. `input_scale`)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**activations) if activations else None)
    n, k = w.shape
    groups = w.view(n, k // (args.group_size or k), -1)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    state = {"weight": w, "weight_scale": scale} | ({} if args.symmetric else {"weight_zero_point": zero_point})
    state |= extra or {}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress(state, scheme)
    decompressed = compressor.decompress(stored | {"weight_scale": stored["weight_scale"].float()}, scheme)
    return stored, decompressed["weight"].float()


def write_library_checkpoint(dense: Path, target: Path, fmt: str, weights: dict, activations: dict | None,
                             extra=lambda prefix: None) -> tuple[Path, dict, dict]:
    """`dense` with every projection compressed by compressed-tensors' compressor for `fmt` (`extra(prefix)`: more
    of that module's state) -> (the checkpoint, its tensors with the decompressed float32 weights for a dense
    reference, {projection prefix: decompressed weight})."""
    tensors, plain = read_weights(dense), {n: t.float() for n, t in read_weights(dense).items()}
    library = {}
    for layer in range(QUANT_SHAPE.num_hidden_layers):
        for projection in PROJECTIONS:
            prefix = f"model.layers.{layer}.{projection}"
            stored, weight = library_compress(tensors.pop(f"{prefix}.weight"), fmt, weights, activations,
                                              extra(prefix))
            tensors.update({f"{prefix}.{key}": value for key, value in stored.items()})
            plain[f"{prefix}.weight"] = library[prefix] = weight
    return write_checkpoint(dense, target, tensors, compressed_config(fmt, weights, activations)), plain, library


def library_fused(library: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """{mili's module name in a layer: the library's weights of its parts, fused}."""
    prefix = f"model.layers.{layer}"
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
             "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",)}
    return {name: torch.cat([library[f"{prefix}.{name.split('.')[0]}.{part}"] for part in parts])
            for name, parts in fused.items()}


def write_quantized(source: Path, target: Path, reference: Path, method: str, **options) -> None:
    """A checkpoint at `target` with every projection (but those in `options["dense"]`) quantized in `method`'s
    layout, and at `reference` the dense float32 checkpoint of the weights those stand for (for transformers)."""
    dense = {name: t.float() for name, t in read_weights(source).items()}
    packed, plain = dict(dense), dict(dense)
    for layer in range(QUANT_SHAPE.num_hidden_layers):
        for projection in PROJECTIONS:
            if projection in options.get("dense", ()):
                continue
            prefix = f"model.layers.{layer}.{projection}"
            w = packed.pop(f"{prefix}.weight")
            if method == "compressed-tensors" and "bits" in options:
                tensors, weight = compressed_int_tensors(prefix, w, options["bits"], options["group"],
                                                         options["symmetric"], options["config"]["format"])
            elif method == "compressed-tensors":
                tensors, weight = compressed_fp8_tensors(prefix, w)
            elif method == "awq":
                tensors, weight = awq_tensors(prefix, w, options["group"])
            elif method == "gptq":
                tensors, weight = gptq_tensors(prefix, w, options["bits"], options["group"], options["symmetric"],
                                               options["stored_zero_offset"])
            else:
                tensors, weight = fp8_tensors(prefix, w, options["block"])
            packed.update(tensors)
            plain[f"{prefix}.weight"] = weight
    write_checkpoint(source, target, packed, options["config"])
    write_checkpoint(source, reference, plain, None)


def write_dequantized(model, source: Path, target: Path) -> Path:
    """A dense float32 checkpoint of what a loaded mili model's (quantized) weights stand for."""
    tensors = {name: t.float() for name, t in read_weights(source).items()}
    config = model.config
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        weights = {name: dequantized_weight(module) for name, module in (
            ("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj))}
        q, k, v = weights["qkv"].split([q_rows, kv_rows, kv_rows])
        gate, up = weights["gate_up"].split(config.intermediate_size)
        tensors.update({f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
                        f"{prefix}.self_attn.v_proj.weight": v, f"{prefix}.self_attn.o_proj.weight": weights["o"],
                        f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up,
                        f"{prefix}.mlp.down_proj.weight": weights["down"]})
    if isinstance(model.lm_head, QuantizedLinear):  # fp8 keeps the checkpoint's head
        head = dequantize(model.lm_head.packed, torch.float32)
        tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"] = head
    return write_checkpoint(source, target, tensors, None)


def dequantized_weight(module) -> torch.Tensor:
    """A quantized projection's weight in float32, on the CPU: int8/int4 packed or fp8."""
    if isinstance(module, Fp8Linear):
        return dequantize_fp8(module.fp8).cpu()
    return dequantize(module.packed, torch.float32).cpu()
