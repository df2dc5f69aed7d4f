"""What a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint holds beyond a Qwen3 one, turned into Qwen3.5's text layout
before the shared name map (model/weights.py) runs.

- `Qwen3_5ForConditionalGeneration` (and the MoE one) keep the language model under `model.language_model.`:
  renamed to `model.`; the vision tower (`model.visual.*`) is taken out before (model/hybrid_loader.py), and
  a text-only checkpoint that carries one anyway has it skipped with a log line.
- The multi-token-prediction weights (`mtp.*`) are taken out and kept (model/mtp.py).
- Gated DeltaNet's conv weight is stored (channels, 1, kernel): squeezed to (channels, kernel).
- Qwen3-Next stores its DeltaNet inputs fused and interleaved per key head: `in_proj_qkvz` rows are, for each
  key head, [q (Dk), k (Dk), v (r * Dv), z (r * Dv)] with r = value heads per key head, and `in_proj_ba` rows
  [b (r), a (r)] (transformers' `fix_query_key_value_ordering`). They are regrouped into Qwen3.5's
  `in_proj_qkv` ([all q; all k; all v]), `in_proj_z`, `in_proj_b` and `in_proj_a`, which carry the same heads
  in the same order.
"""

from __future__ import annotations

import logging

import torch

from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_config import LINEAR_ATTENTION, LinearAttentionConfig
from mili_openai.model.mtp import MultiTokenPredictorWeights, take_mtp_weights
from mili_openai.model.weights import LAYER_PREFIX

logger = logging.getLogger(__name__)

LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_MODEL_PREFIX = "model."
VISION_PREFIXES = ("model.visual.", "visual.")
CONV_WEIGHT = "linear_attn.conv1d.weight"
FUSED_QKVZ = "linear_attn.in_proj_qkvz.weight"
FUSED_BA = "linear_attn.in_proj_ba.weight"
SPLIT_PROJECTIONS = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                     "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")


def prepare_hybrid_tensors(tensors: dict[str, torch.Tensor],
                           config: ModelConfig) -> tuple[MultiTokenPredictorWeights | None, list[str]]:
    """Rewrite a hybrid checkpoint's tensors (in place) into Qwen3.5's text layout -> (its MTP weights or None,
    checkpoint names found missing)."""
    for name in [n for n in tensors if n.startswith(LANGUAGE_MODEL_PREFIX)]:
        tensors[TEXT_MODEL_PREFIX + name.removeprefix(LANGUAGE_MODEL_PREFIX)] = tensors.pop(name)
    vision = [name for name in tensors if name.startswith(VISION_PREFIXES)]
    for name in vision:
        del tensors[name]
    if vision:
        logger.info("skipped the vision tower's %d tensors: the config declares a text-only model", len(vision))
    mtp = take_mtp_weights(tensors, config.hybrid.mtp_num_hidden_layers)
    if mtp is None and config.hybrid.mtp_num_hidden_layers:
        logger.warning("the config names %d MTP layers but the checkpoint has no mtp.* weights: MTP speculative "
                       "decoding will not be available for it", config.hybrid.mtp_num_hidden_layers)
    missing: list[str] = []
    for index in config.hybrid.linear_layers:
        prefix = f"{LAYER_PREFIX}.{index}"
        conv = tensors.get(f"{prefix}.{CONV_WEIGHT}")
        if conv is not None and conv.dim() == 3:
            tensors[f"{prefix}.{CONV_WEIGHT}"] = conv.squeeze(1)
        if config.hybrid.linear.fused_projections:
            missing += _split_fused_projections(tensors, prefix, config)
    return mtp, missing


def _split_fused_projections(tensors: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> list[str]:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba of one layer -> Qwen3.5's four projections; -> names missing."""
    qkvz, ba = (tensors.pop(f"{prefix}.{name}", None) for name in (FUSED_QKVZ, FUSED_BA))
    absent = [f"{prefix}.{name}" for name, t in ((FUSED_QKVZ, qkvz), (FUSED_BA, ba)) if t is None]
    if absent:
        return absent
    for name, tensor in zip(SPLIT_PROJECTIONS, regroup_fused_projections(qkvz, ba, config.hybrid.linear)):
        tensors[f"{prefix}.{name}"] = tensor
    return []


def regroup_fused_projections(qkvz: torch.Tensor, ba: torch.Tensor,
                              linear: LinearAttentionConfig) -> tuple[torch.Tensor, ...]:
    """Rows of Qwen3-Next's in_proj_qkvz (Hk * (2 Dk + 2 r Dv), C) and in_proj_ba (Hk * 2r, C), interleaved per key
    head -> Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a rows (any C: a weight's, or LoRA's B)."""
    per_key = linear.num_value_heads // linear.num_key_heads
    groups = qkvz.view(linear.num_key_heads, -1, qkvz.shape[-1])  # (Hk, 2 Dk + 2 r Dv, C)
    q, k, v, z = groups.split((linear.key_head_dim, linear.key_head_dim, per_key * linear.value_head_dim,
                               per_key * linear.value_head_dim), dim=1)
    b, a = ba.view(linear.num_key_heads, 2 * per_key, ba.shape[-1]).split((per_key, per_key), dim=1)
    flat = [x.reshape(-1, qkvz.shape[-1]) for x in (q, k, v, z, b, a)]
    return (torch.cat(flat[:3]), *flat[3:])
