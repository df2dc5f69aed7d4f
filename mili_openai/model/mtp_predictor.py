"""The multi-token-prediction (MTP) module of Qwen3.5 / Qwen3.6 / Qwen3-Next, run as a draft model.

At position p it reads the target's final hidden state h_p (after the final norm) and the embedding of the
token at p + 1, and predicts the token at p + 2:
    x = fc([pre_fc_norm_embedding(embed(token_{p+1})); pre_fc_norm_hidden(h_p)])      (2 * hidden -> hidden)
    x = one full-attention decoder layer at position p (its own K/V, in the sequence's pages)
    logits = lm_head(norm(x))                                                       (the target's head)
Chained for more drafts: the next step reads its own normed output as h and its draft as the token, at p + 1
(vLLM's qwen3_next_mtp / SGLang's). With several MTP layers, step i runs layer i mod their count. Every norm
is zero-centred, as the target's. The K/V of MTP layer i is the model's cache layer `num_hidden_layers + i`
(`Qwen3_5ForCausalLM.num_mtp_cache_layers`), so the engine's page pool holds it beside the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.hybrid_config import FULL_ATTENTION
from mili_openai.model.hybrid_norms import ZeroCenteredRMSNorm
from mili_openai.model.layers import Linear
from mili_openai.model.qwen3_5 import HybridDecoderLayer, Qwen3_5ForCausalLM
from mili_openai.model.weights import CheckpointError, fuse_layer_tensors, take_named_tensors


class MultiTokenPredictor(nn.Module):
    def __init__(self, model: Qwen3_5ForCausalLM, num_layers: int) -> None:
        super().__init__()
        config = model.config
        hidden = config.hidden_size
        backend = model.backend  # the target's: the MTP module runs on the same kernels
        self.fc = Linear(2 * hidden, hidden, backend)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps, backend)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps, backend)
        self.norm = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps, backend)
        # built as the target's first attention layer (its kind of MLP too), then renumbered to its own cache layer
        self.source_layer = config.hybrid.layer_types.index(FULL_ATTENTION)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, self.source_layer, backend)
                                    for _ in range(num_layers))
        for offset, layer in enumerate(self.layers):
            layer.index = config.num_hidden_layers + offset
        self.sparse = config.is_sparse_layer(self.source_layer)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, caches: ModelCaches, step: int) -> torch.Tensor:
        """embeds (T, hidden) of the next tokens, hidden (T, hidden) the target's (or the step before's) normed
        states -> (T, hidden) normed, for the LM head; writes the layer's K/V at `batch.slot_mapping`."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        layer = self.layers[step % len(self.layers)]
        out, residual = layer(x, None, *rotary, batch, None, caches)
        return self.norm.add_and_norm(out, residual)[1]


def attach_mtp_predictor(model: Qwen3_5ForCausalLM) -> MultiTokenPredictor:
    """Build the MTP module from the checkpoint's kept `mtp.*` weights (model.mtp), on the target's backend, and
    give the model its cache layers; ValueError where the checkpoint has none."""
    weights = model.mtp
    if weights is None or weights.num_layers == 0:
        raise ValueError(f"speculative method \"mtp\": the checkpoint ({model.config.architecture}) carries no MTP "
                         "weights (mtp.*)")
    tensors = dict(weights.named_buffers())
    reference = next(iter(tensors.values()))
    with torch.device("meta"):
        predictor = MultiTokenPredictor(model, weights.num_layers)
    expected = set(predictor.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for index in range(weights.num_layers):
        fuse_layer_tensors(tensors, f"layers.{index}", model.config, predictor.sparse, expected, state, missing)
    try:
        state = take_named_tensors(tensors, expected, state, missing)
        predictor.load_state_dict(state, strict=True, assign=True)
    except (CheckpointError, RuntimeError) as exc:
        raise CheckpointError(f"the checkpoint's MTP weights do not fit its config: {exc}") from exc
    predictor.to(device=reference.device)
    predictor.requires_grad_(False).eval()
    model.mtp = None  # its tensors now live in the predictor
    model.mtp_predictor = predictor
    model.num_mtp_cache_layers = weights.num_layers
    return predictor

