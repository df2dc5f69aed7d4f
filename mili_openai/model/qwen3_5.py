"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next for causal LM: the hybrid decoder, over a flattened batch,
the paged KV cache of its attention layers and the per-sequence state slots of its linear ones.

Each decoder layer mixes tokens with either Gated DeltaNet (model/gated_deltanet.py; `linear_attn`) or gated
full attention (model/gated_attention.py; `self_attn`), as `config.hybrid.layer_types` says (three of every
four are linear), then a SwiGLU MLP, or a sparse MoE block with a gated shared expert. Every norm but the
DeltaNet's gated one is zero-centred (1 + w). Module names follow transformers' language model
(`model.layers.N.linear_attn.out_proj`, `model.norm`, `lm_head`), with the fusions the loader maps
(model/hybrid_weights.py): `linear_attn.in_proj`, `self_attn.qkv_proj`, `mlp.gate_up_proj`,
`mlp.shared_expert.gate_up_proj`, stacked experts. A checkpoint's multi-token-prediction weights are kept in
`mtp` (model/mtp.py); speculative decoding builds its module from them (model/mtp_predictor.py).

Under tensor parallelism (`parallel` given) every module is built in this rank's shapes (model/tensor_parallel.py,
model/hybrid_tensor_parallel.py): each mixer's and MLP's output is summed over the ranks before its residual add,
the embedding is vocabulary-parallel and the logits are gathered. No compiled decode stack: every layer runs
module by module.
"""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.distributed import TensorParallelGroup
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import LayerCacheSpec, ModelCaches, PagedKVSpec, RecurrentStateSpec
from mili_openai.model.config import ModelConfig
from mili_openai.model.gated_attention import GatedAttention
from mili_openai.model.gated_deltanet import GatedDeltaNet, StateRows
from mili_openai.model.hybrid_config import LINEAR_ATTENTION
from mili_openai.model.hybrid_norms import ZeroCenteredRMSNorm
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.layers import Linear, SwiGLUMLP, embedding_table
from mili_openai.model.moe import SharedExpertMoeBlock, SparseMoeBlock
from mili_openai.model.mtp import MultiTokenPredictorWeights
from mili_openai.model.quantization.modules import QuantizedLinear
from mili_openai.model.qwen3_5_vision import Qwen3_5VisionTower
from mili_openai.model.rope import RotaryEmbedding, RotaryTable
from mili_openai.model.vision_batch import ImageEmbeddingCache, mrope_pair_streams
from mili_openai.model.vision_step import step_image_embeddings, step_rotary
from mili_openai.model.tensor_parallel import VocabParallelEmbedding, shard_config


def _mlp(config: ModelConfig, index: int, backend: KernelBackend) -> nn.Module:
    moe = config.moe
    if not config.is_sparse_layer(index):
        return SwiGLUMLP(config.hidden_size, config.intermediate_size, backend)
    return SharedExpertMoeBlock(config.hidden_size, moe.num_experts, moe.num_experts_per_tok,
                                moe.moe_intermediate_size, moe.norm_topk_prob, moe.shared_expert_intermediate_size,
                                backend)


def _linear_spec(layer: GatedDeltaNet) -> RecurrentStateSpec:
    return RecurrentStateSpec((layer.conv_dim, layer.conv1d.weight.shape[1] - 1),
                              (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, backend: KernelBackend,
                 parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.index = index
        self.parallel = parallel
        self.is_linear = config.hybrid.layer_type(index) == LINEAR_ATTENTION
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, backend)
        else:
            self.self_attn = GatedAttention(config, backend)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = _mlp(config, index, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, rows: StateRows | None, caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it), both (T, hidden), as Qwen3DecoderLayer."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(hidden, residual)
        if self.is_linear:
            conv_pool, state_pool = caches.state.layer(self.index)
            mixed = self.linear_attn(normed, rows, conv_pool, state_pool, caches.state.kept(self.index))
        else:
            k_pool, v_pool = caches.kv.layer(self.index)
            mixed = self.self_attn(normed, cos, sin, batch, k_pool, v_pool)
        residual, normed = self.post_attention_layernorm.add_and_norm(self._sum(mixed), residual)
        return self._sum(self.mlp(normed)), residual

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (in place); as is without tensor parallelism."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = (embedding_table(config.vocab_size, config.hidden_size) if parallel is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel))
        self.layers = nn.ModuleList(HybridDecoderLayer(config, index, backend, parallel)
                                    for index in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.rotary_emb = RotaryEmbedding(config)  # over the rotary_dim leading dims of each head
        sections = config.hybrid.mrope_section
        with torch.device("cpu"):  # built on CPU even under the loader's meta device; moved where it is read
            self.mrope_streams = (mrope_pair_streams(sections, config.rotary_dim // 2) if sections is not None
                                  else torch.zeros(config.rotary_dim // 2, dtype=torch.int64))
        self.decode_stack = None  # no compiled decode stack for the hybrids: the runner reads it as Qwen3's

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(self, batch: ForwardBatch, caches: ModelCaches, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`image_embeds` (R, 1, hidden): the step's image rows' embeddings (step_image_embeddings)."""
        cos, sin = step_rotary(batch, self.rotary_emb, self.mrope_streams, self.dtype)
        rows = StateRows.of(batch)
        hidden = self.embed_tokens(batch.input_ids)  # (T, hidden)
        if image_embeds is not None:
            hidden[batch.vision.rows.to(hidden.device)] = image_embeds[:, 0].to(hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, batch, rows, caches)
        return self.norm.add_and_norm(hidden, residual)[1]


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend,
                 parallel: TensorParallelGroup | None = None) -> None:
        """`backend`: the kernels every module calls, as for Qwen3ForCausalLM. Its norms are zero-centred, which
        the fused norm kernels are not, so only its SwiGLU activations take `fused_ops`, and no residual add +
        norm kernel runs."""
        super().__init__()
        if config.hybrid is None:
            raise ValueError(f"{config.architecture} is not a hybrid model: load it as Qwen3ForCausalLM")
        self.config = config  # the whole model's; the modules hold this rank's shapes under `parallel`
        self.parallel = parallel
        local = shard_config(config, parallel.size) if parallel is not None else config
        self.backend = require_backend(backend)
        self.model = HybridModel(local, backend, parallel)
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings
                                          else Linear(config.hidden_size, local.vocab_size, backend))
        self.mtp: MultiTokenPredictorWeights | None = None  # the checkpoint's MTP weights (model/mtp.py)
        self.visual: Qwen3_5VisionTower | None = None  # a vision-language checkpoint's tower (model.visual.*)
        self.image_cache = ImageEmbeddingCache()
        # the MTP module built from them for speculative decoding (model/mtp_predictor.py), and its K/V layers,
        # which follow the decoder's in cache_specs(); none until the engine drafts with it
        self.mtp_predictor: nn.Module | None = None
        self.num_mtp_cache_layers = 0
        self.quantization: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def cache_specs(self) -> list[LayerCacheSpec]:
        """One spec per decoder layer (model/cache_spec.py): K/V pages for attention layers; for linear ones a
        conv window (the last K-1 inputs of every conv channel) and an fp32 (Dk, Dv) state per value head (this
        rank's heads under tensor parallelism); the MTP module's K/V layers follow the decoder's."""
        specs = [_linear_spec(layer.linear_attn) if layer.is_linear
                 else PagedKVSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.model.layers]
        mtp_attention = PagedKVSpec(self.config.num_key_value_heads, self.config.head_dim)
        return specs + [mtp_attention] * self.num_mtp_cache_layers

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run every token of the batch, writing K/V into `caches.kv` and each sequence's state into its slot of
        `caches.state`; -> (T, hidden) after the final norm."""
        if caches.kv is None or caches.state is None:
            raise ValueError("a hybrid model needs both a KV cache (attention layers) and a state cache (linear ones)")
        if caches.kv.dtype != self.dtype:
            raise ValueError(f"KV cache dtype {caches.kv.dtype} differs from the model's {self.dtype}")
        image_embeds = step_image_embeddings(batch, self.visual, self.image_cache, self.config.architecture)
        return self.model(batch, caches, image_embeds)

    def rotary_table(self) -> RotaryTable:
        return RotaryTable(self.model.rotary_emb, self.dtype)

    def compute_logits(self, hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) float32; computed in the weights' dtype like transformers.
        head_rows: rows of the LM head to use instead of it all (a draft's token map) -> (N, len(head_rows))."""
        if head_rows is not None:
            return self.backend.matmul(hidden, head_rows).float()
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head(hidden).float()
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = self.backend.matmul(hidden, weight)  # (N, vocab slice)
        if self.parallel is not None:  # every rank's slice, the padding past the vocabulary cut off
            logits = self.parallel.all_gather_last(logits)[:, : self.config.vocab_size]
        return logits.float()

    def expert_load(self) -> dict[int, list[int]]:
        return {index: layer.mlp.expert_load.tolist() for index, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)}

    @property
    def holds_packed_weights(self) -> bool:
        return any(isinstance(module, QuantizedLinear) for module in self.modules())

    def build_decode_stack(self) -> None:
        """No compiled decode stack runs linear attention yet: every step runs layer by layer."""
        self.model.decode_stack = None
