"""Pre-quantized Qwen3.5 checkpoints through the existing formats: every projection of both layer kinds (Gated
DeltaNet's in_proj_qkv / _z / _b / _a and out_proj, gated attention's q_proj with its gate rows, k/v/o, the MLP)
stored as FP8 blocks or GPTQ int8, greedy tokens identical to transformers' on the weights they stand for
(dequantized by the tests' own writer); MoE and Qwen3-Next's fused layout refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from engine_helpers import assert_matches, greedy, hf_greedy
from hybrid_helpers import hybrid_tokens, transformers_class
from quant_helpers import fp8_tensors, gptq_tensors, read_weights, write_checkpoint

from mili_openai import LLM
from mili_openai.model import load_model

PROJECTION = re.compile(r"^model\.layers\.\d+\.(linear_attn\.(in_proj_(qkv|z|b|a)|out_proj)|"
                        r"self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
GPTQ_INT8 = {"quant_method": "gptq", "desc_act": False, "sym": True, "static_groups": False, "bits": 8,
             "group_size": -1}
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
FORMATS = {"fp8": FP8_BLOCKS, "gptq": GPTQ_INT8}
PROMPT_LENGTHS = [1, 9, 40, 75]
MAX_NEW = 8


def write_quantized_hybrid(source, target, reference, method: str) -> int:
    """Every decoder projection of `source` quantized in `method`'s layout at `target`; at `reference` the dense
    float32 weights they stand for. -> how many projections were quantized."""
    dense = {name: t.float() for name, t in read_weights(source).items()}
    packed, plain, count = dict(dense), dict(dense), 0
    for name in dense:
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or not PROJECTION.match(prefix):
            continue
        w = packed.pop(name)
        if method == "fp8":
            tensors, weight = fp8_tensors(prefix, w, tuple(FP8_BLOCKS["weight_block_size"]))
        else:
            tensors, weight = gptq_tensors(prefix, w, 8, None, True, 1)
        packed.update(tensors)
        plain[name] = weight
        count += 1
    write_checkpoint(source, target, packed, FORMATS[method])
    write_checkpoint(source, reference, plain, None)
    return count


@pytest.mark.parametrize("method", list(FORMATS))
def test_prequantized_qwen35_matches_transformers_on_its_dequantized_weights(hybrid_checkpoint, method, tmp_path):
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    count = write_quantized_hybrid(hybrid_checkpoint("qwen3_5"), quantized, reference, method)
    assert count == 3 * 8 + 7  # 3 linear layers: 4 in_proj parts, out_proj, the MLP's 3; an attention layer: 4 + 3
    hf = transformers_class("qwen3_5").from_pretrained(str(reference), dtype=torch.float32).eval()
    prompts = [hybrid_tokens(length, seed=300 + length) for length in PROMPT_LENGTHS]
    expected = [hf_greedy(hf, prompt, MAX_NEW) for prompt in prompts]
    llm = LLM(str(quantized), dtype="float32", num_pages=128, page_size=8, max_num_batched_tokens=48)
    assert llm.core.info.quantization.startswith(method)
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)


@pytest.mark.parametrize("layout", ["qwen3_5_moe", "qwen3_next"])
def test_moe_and_fused_layouts_are_refused_by_name(hybrid_checkpoint, layout, tmp_path):
    source = hybrid_checkpoint(layout)
    write_checkpoint(source, tmp_path / "fp8", read_weights(source), FP8_BLOCKS)
    with pytest.raises(NotImplementedError, match="pre-quantized checkpoints \\(fp8\\) load for the dense"):
        load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"), use_decode_kernel=False)
