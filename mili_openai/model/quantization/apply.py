"""Putting a quantization scheme into a Qwen3 model: quantizing its dense projections after load
(`--quantization`), or building them from a pre-quantized checkpoint's tensors before load.

The LM head: under int8 and int4 it is quantized to int8 with one scale per row by default (at least int8,
as llama.cpp keeps its output matrix above 4 bits), or to int4 when asked (`--quantize-lm-head int4`: groups
and zero points as the layers', the fewest bytes per token); tied to the embedding (Qwen3-0.6B), the
embedding then reads its rows from the same quantized matrix, dequantized row by row, rather than keeping a
bf16 copy. Under fp8 it stays dense, as in vLLM. Pre-quantized checkpoints keep whatever the checkpoint holds.

compressed-tensors W8A8 projections quantize their input to int8 (activations.py); a fused projection (q, k,
v or gate, up) of static per-tensor scales quantizes its shared input with the largest of its parts' scales,
as vLLM does.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mili_openai.kernels.fp8 import Fp8Weights, dequantize_fp8, per_row_weights
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_config import LINEAR_ATTENTION
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.layers import Linear
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.quantization.activations import Int8Activations
from mili_openai.model.quantization.compressed_tensors import STATIC_TENSOR, CompressedTensorsScheme
from mili_openai.model.quantization.dynamic import quantize_fp8, quantize_int4, quantize_int8
from mili_openai.model.quantization.formats import (
    float16_rounded,
    pack_rows,
    read_awq,
    read_compressed_fp8,
    read_compressed_int,
    read_fp8,
    read_gptq,
    read_input_scale,
)
from mili_openai.model.quantization.modules import Fp8Linear, QuantizedEmbedding, QuantizedLinear
from mili_openai.model.quantization.spec import COMPRESSED_TENSORS, CheckpointQuantization
from mili_openai.model.weights import FUSED_PARTS, LAYER_PREFIX, CheckpointError

logger = logging.getLogger(__name__)

LAYER_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# a Gated DeltaNet layer's (Qwen3.5's split in_proj_qkv / _z / _b / _a fused into one), then its MLP's
LINEAR_ATTENTION_PROJECTIONS = ("linear_attn.in_proj", "linear_attn.out_proj", "mlp.gate_up_proj", "mlp.down_proj")
LM_HEAD = "lm_head"
LM_HEAD_METHODS = ("int8", "int4")
QUANTIZED_MARKERS = {"awq": "qweight", "gptq": "qweight", "fp8": "weight_scale_inv"}
INT_READERS = {"awq": read_awq, "gptq": read_gptq, COMPRESSED_TENSORS: read_compressed_int}


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attribute = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attribute


def quantize_model(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, method: str, group_size: int, lm_head: str = "int8") -> str:
    """Quantize every decoder projection (and the LM head to `lm_head`, int8 or int4: see the module
    docstring) in place, freeing the dense weights; -> what was done, for the start-up log and /v1/models."""
    if method != "fp8" and lm_head not in LM_HEAD_METHODS:
        raise ValueError(f"the LM head quantizes to one of {LM_HEAD_METHODS}, got {lm_head!r}")
    # every projection of every decoder layer: Qwen3's four (LAYER_PROJECTIONS), or a hybrid layer's own
    # (Gated DeltaNet's in_proj / out_proj or gated attention's, and the MLP's)
    projections = [name for name, module in model.model.layers.named_modules() if isinstance(module, Linear)]
    for name in projections:
        parent, attribute = _parent(model, f"{LAYER_PREFIX}.{name}")
        dense = getattr(parent, attribute).weight.detach()
        setattr(parent, attribute, _quantized(dense, method, group_size, model.backend))
    if method == "fp8":
        return ("fp8 (e4m3 weights with a scale per row: weight-only for decode batches, activations per token for "
                "prefill; LM head unquantized)")
    tied = model.lm_head is None
    head = model.model.embed_tokens.weight if tied else model.lm_head.weight
    model.lm_head = _quantized(head.detach(), lm_head, group_size, model.backend)
    if tied:
        model.model.embed_tokens = QuantizedEmbedding(model.lm_head, model.dtype)
    int4 = f"int4 (groups of {group_size}, zero points)"
    layers = "int8 (a scale per row)" if method == "int8" else int4
    return f"{layers}; LM head {lm_head if lm_head == 'int8' else int4}" + (
        " (the embedding reads its rows)" if tied else "")


def _quantized(dense: torch.Tensor, method: str, group_size: int, backend: KernelBackend) -> nn.Module:
    if method == "int8":
        return QuantizedLinear(quantize_int8(dense), backend)
    if method == "int4":
        return QuantizedLinear(quantize_int4(dense, group_size), backend)
    return Fp8Linear(per_row_weights(*quantize_fp8(dense)), backend)


def load_checkpoint_quantization(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, tensors: dict[str, torch.Tensor],
                                 quant: CheckpointQuantization, dtype: torch.dtype, device: torch.device) -> str:
    """Build each quantized projection of a pre-quantized checkpoint (its tensors popped from `tensors`, fused
    projections concatenated) and put it in `model` (built on the meta device). FP8 projections that run
    dense (on CPU, or whose blocks do not line up for fusing) go back into `tensors` dequantized, under their
    checkpoint names, for the dense load. -> a description."""
    scheme = quant.scheme
    marker = scheme.marker if scheme is not None else QUANTIZED_MARKERS[quant.method]
    fp8 = quant.method == "fp8" or (scheme is not None and scheme.type == "float")
    dense_fp8 = rounded = 0
    for name, prefixes in _projections(model.config):
        quantized = [p for p in prefixes if f"{p}.{marker}" in tensors]
        if scheme is not None:
            _check_targets(scheme, prefixes, quantized, tensors)
        if not quantized:
            continue
        if len(quantized) != len(prefixes):
            raise CheckpointError(f"{name}: some of {', '.join(prefixes)} are quantized and some not")
        if name == LM_HEAD and model.config.tie_word_embeddings:
            raise CheckpointError("a quantized LM head tied to the embedding is not supported")
        if fp8:
            read_float = read_fp8 if scheme is None else read_compressed_fp8
            parts = [read_float(tensors, p, quant) for p in prefixes]
            module = _fp8_module(parts, device, model.backend)
            if module is None:  # dense: dequantized here, fused by the dense load
                for prefix, part in zip(prefixes, parts):
                    tensors[f"{prefix}.weight"] = dequantize_fp8(part).to(dtype)
                dense_fp8 += 1
                continue
        else:
            read_int = INT_READERS[quant.method]
            rows = [read_int(tensors, p, quant) for p in prefixes]
            rounded += float16_rounded(rows) if quant.bits == 4 else 0
            activations = _input_activations(scheme, tensors, prefixes)
            module = QuantizedLinear(pack_rows(rows, quant.bits, name), model.backend, activations)
        parent, attribute = _parent(model, name)
        setattr(parent, attribute, module.to(device))
    description = quant.describe()
    if rounded:
        logger.warning("%d int4 scales were rounded to float16, the int4 kernels' scale type (they are bf16 below "
                       "2^-17 or float32 in the checkpoint)", rounded)
        description += f"; {rounded} scales rounded to float16"
    if dense_fp8:
        logger.info("fp8 checkpoint: %d projections dequantized to %s at load (fp8 matmuls need a CUDA GPU)",
                    dense_fp8, dtype)
        return f"{description}, dequantized to {str(dtype).removeprefix('torch.')} at load"
    return description


def _check_targets(scheme: CompressedTensorsScheme, prefixes: list[str], quantized: list[str],
                   tensors: dict[str, torch.Tensor]) -> None:
    """A compressed-tensors module stored quantized exactly where the config's targets and ignore say so."""
    for prefix in prefixes:
        stored, declared = prefix in quantized, scheme.quantizes(prefix)
        if declared != stored and (stored or f"{prefix}.weight" in tensors):
            raise CheckpointError(f"{prefix}: config.json's quantization_config "
                                  f"{'quantizes it' if declared else 'leaves it unquantized (ignore, targets)'}, but "
                                  f"the checkpoint stores it {'quantized' if stored else 'dense'}")


def _input_activations(scheme: CompressedTensorsScheme | None, tensors: dict[str, torch.Tensor],
                       prefixes: list[str]) -> Int8Activations | None:
    """A W8A8 projection's int8 input quantization (None: weight-only): static, one scale for the fused parts."""
    if scheme is None or scheme.activations is None:
        return None
    if scheme.activations != STATIC_TENSOR:
        return Int8Activations()
    return Int8Activations(torch.stack([read_input_scale(tensors, prefix) for prefix in prefixes]).amax())


def _fp8_module(parts: list[Fp8Weights], device: torch.device, backend: KernelBackend) -> nn.Module | None:
    """The fused fp8 projection on CUDA, or None (dense) on CPU or where a part's rows end inside a block."""
    if device.type != "cuda" or any(part.weight.shape[0] % part.block[0] for part in parts[:-1]):
        return None
    return Fp8Linear(Fp8Weights(torch.cat([p.weight for p in parts]), torch.cat([p.scales for p in parts]),
                                parts[0].block), backend)


def _projections(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """(our module name, the checkpoint prefixes it is made of) for every projection and the LM head."""
    out = []
    for layer in range(config.num_hidden_layers):
        prefix = f"{LAYER_PREFIX}.{layer}"
        linear = config.hybrid is not None and config.hybrid.layer_type(layer) == LINEAR_ATTENTION
        for projection in LINEAR_ATTENTION_PROJECTIONS if linear else LAYER_PROJECTIONS:
            parts = FUSED_PARTS.get(projection, (projection,))
            out.append((f"{prefix}.{projection}", [f"{prefix}.{part}" for part in parts]))
    out.append((LM_HEAD, [LM_HEAD]))
    return out
