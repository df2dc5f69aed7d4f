"""What the model runner sets up for speculative decoding at load: the MTP module attached to the target, or the
draft model loaded beside it, and the runner's part of each step (engine/speculation.py) with its proposer."""

from __future__ import annotations

from pathlib import Path

import torch

from mili_openai.config import DRAFT_MODEL_SPECULATIVE_METHOD, MTP_SPECULATIVE_METHOD, EngineConfig, SpeculativeConfig
from mili_openai.engine.draft_head import DraftHead, load_token_map
from mili_openai.engine.draft_model import DraftModel, DraftModelDrafter, load_draft_model
from mili_openai.engine.mtp_drafter import MtpDrafter
from mili_openai.engine.speculation import StepSpeculation
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.mtp_predictor import attach_mtp_predictor


def prepare_model_for_speculation(config: EngineConfig, model, model_path: Path, device: torch.device,
                                  defer_cpu_kernels: bool) -> DraftModel | None:
    """Before the runner sizes its caches: attach the MTP module (and its K/V layers) where it drafts, or load the
    draft model (returned; None for other methods); refuse a method that cannot run on this model."""
    speculative = config.speculative_config
    if speculative is None:
        return None
    if speculative.method == DRAFT_MODEL_SPECULATIVE_METHOD:
        return load_draft_model(config, model_path, model.config, model.dtype, device, defer_cpu_kernels)
    if speculative.method == MTP_SPECULATIVE_METHOD:
        if not hasattr(model, "mtp_predictor"):
            raise ValueError(f'speculative method "mtp" needs a model with an MTP module (Qwen3.5 / Qwen3.6 / '
                             f"Qwen3-Next), not {model.config.architecture}")
        attach_mtp_predictor(model)
    return None


def runner_speculation(config: SpeculativeConfig | None, model, caches: ModelCaches, page_size: int,
                       draft: DraftModel | None = None, draft_caches: ModelCaches | None = None
                       ) -> StepSpeculation | None:
    """The runner's part of speculative decoding; None where it has none (no linear layer to roll back, no
    model proposer)."""
    if config is None:
        return None
    if draft is not None:
        drafter = DraftModelDrafter(draft, draft_caches, config.num_speculative_tokens, page_size,
                                    draft_head(config, draft.model))
    elif config.method == MTP_SPECULATIVE_METHOD:
        drafter = MtpDrafter(model, caches, config.num_speculative_tokens, page_size, draft_head(config, model))
    elif caches.state is None:
        return None
    else:
        drafter = None
    return StepSpeculation(caches.state, drafter)


def draft_head(config: SpeculativeConfig, model) -> DraftHead:
    """The drafts' logits of `model`: over its whole vocabulary, or over the token map's ids where one is given."""
    if config.token_map is None:
        return DraftHead(model)
    return DraftHead(model, load_token_map(config.token_map, model.config.vocab_size))
