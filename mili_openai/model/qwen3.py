"""Qwen3 for causal LM in plain torch, over a flattened batch and a paged KV cache.

Module names follow transformers' (`model.embed_tokens`, `model.layers.N.self_attn.o_proj`, `model.norm`,
`lm_head`) except two fusions the loader maps: `qkv_proj` = [q_proj; k_proj; v_proj] and
`gate_up_proj` = [gate_proj; up_proj], so a decode step reads each layer's input-side weights in two
matmuls instead of five. With tied embeddings there is no `lm_head`: logits use the embedding matrix.

Qwen3-MoE is the same model with `SparseMoeBlock`s in place of the MLP in the layers its config names.
Qwen3-VL (`config.vision`) is the same language model with mRoPE positions and a vision tower (`visual`): image rows
take the tower's embeddings, and its DeepStack features are added after the first decoder layers at those rows.
Under tensor parallelism (`parallel` given) every module is built in this rank's shapes
(model/tensor_parallel.py); the attention and MLP outputs are summed over the ranks before each residual
add, the embedding is vocabulary-parallel, and the logits are gathered from every rank's vocabulary slice.
"""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.distributed import TensorParallelGroup
from mili_openai.kernels.cpu import SparseMoeWeights
from mili_openai.kernels.quantized import PackedWeights
from mili_openai.model.attention import Qwen3Attention
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import LayerCacheSpec, ModelCaches, PagedKVSpec
from mili_openai.model.config import ModelConfig
from mili_openai.model.kernel_backend import DecodeStack, KernelBackend, require_backend
from mili_openai.model.kv_cache import KVCache
from mili_openai.model.layers import Linear, RMSNorm, SwiGLUMLP, embedding_table
from mili_openai.model.moe import SparseMoeBlock
from mili_openai.model.quantization.modules import QuantizedEmbedding, QuantizedLinear
from mili_openai.model.qwen3_5_vision import Qwen3_5VisionTower
from mili_openai.model.rope import RotaryEmbedding, RotaryTable
from mili_openai.model.tensor_parallel import VocabParallelEmbedding, shard_config
from mili_openai.model.vision_batch import ImageEmbeddingCache, mrope_pair_streams
from mili_openai.model.vision_step import step_image_embeddings, step_rotary


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, backend: KernelBackend,
                 parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = Qwen3Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        moe = config.moe
        self.mlp = (SparseMoeBlock(config.hidden_size, moe.num_experts, moe.num_experts_per_tok,
                                   moe.moe_intermediate_size, moe.norm_topk_prob, backend)
                    if config.is_sparse_layer(index)
                    else SwiGLUMLP(config.hidden_size, config.intermediate_size, backend))
        self.parallel = parallel

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it), both (T, hidden): the next layer's input norm
        (or the final one) adds the two, so each add and the norm after it can run as one kernel. `residual`
        None: `hidden` is the embedding, the stream's start. Residual adds land in the layers' fresh outputs:
        no new (T, hidden) buffer per add."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self._sum(self.self_attn(normed, cos, sin, batch, k_pool, v_pool))
        residual, normed = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self._sum(self.mlp(normed)), residual

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (in place); as is without tensor parallelism."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = (embedding_table(config.vocab_size, config.hidden_size) if parallel is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, index, backend, parallel)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.rotary_emb = RotaryEmbedding(config)
        with torch.device("cpu"):  # built on CPU even under the loader's meta device; moved where it is read
            # Qwen3-VL: the position stream each rotary pair reads (text rows read the same position on all three)
            self.mrope_streams = mrope_pair_streams(config.vision.mrope_section if config.vision is not None
                                                    else (config.rotary_dim // 2, 0, 0), config.rotary_dim // 2)
        self.decode_stack: DecodeStack | None = None  # built by Qwen3ForCausalLM.build_decode_stack

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the dense weights' (norms are never quantized)."""
        return self.norm.weight.dtype

    def forward(self, batch: ForwardBatch, kv_cache: KVCache, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """-> (T, hidden) after the final norm; every layer attends, so only the K/V pool is read.
        `image_embeds` (R, 1 + DeepStack layers, hidden): the step's image rows' embeddings (Qwen3-VL)."""
        cos, sin = step_rotary(batch, self.rotary_emb, self.mrope_streams, self.dtype)
        stack = self.decode_stack
        if (stack is not None and not batch.prefills and batch.decode_ctx_lens is not None
                and batch.num_decode <= stack.max_rows):
            hidden = stack.forward(batch.input_ids, cos, sin, kv_cache.pools, batch.slot_mapping,
                                   batch.pages.decode, batch.pages.page_size, batch.decode_ctx_lens)
            return self.norm(hidden)
        hidden = self.embed_tokens(batch.input_ids)  # (T, hidden)
        image_rows = None if image_embeds is None else batch.vision.rows.to(hidden.device)
        if image_rows is not None:
            image_embeds = image_embeds.to(hidden.dtype)
            hidden[image_rows] = image_embeds[:, 0]
        residual = None
        for index, layer in enumerate(self.layers):
            k_pool, v_pool = kv_cache.layer(index)
            hidden, residual = layer(hidden, residual, cos, sin, batch, k_pool, v_pool)
            if image_rows is not None and index + 1 < image_embeds.shape[1]:
                # DeepStack, as transformers: the layer's output (the residual add made here), plus the features
                hidden = hidden + residual
                hidden[image_rows] += image_embeds[:, index + 1]
                residual = None
        return self.norm.add_and_norm(hidden, residual)[1] if residual is not None else self.norm(hidden)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend,
                 parallel: TensorParallelGroup | None = None) -> None:
        """`backend`: the kernels every module calls (model/kernel_backend.py), shared by all of them; the loader
        fills it for the device once the weights are in (a fresh `KernelBackend()` runs torch's ops)."""
        super().__init__()
        self.config = config  # the whole model's; the modules hold this rank's shapes under `parallel`
        self.parallel = parallel
        self.backend = require_backend(backend)
        local = shard_config(config, parallel.size) if parallel is not None else config
        self.model = Qwen3Model(local, self.backend, parallel)
        # with tied embeddings there is no head (logits use the embedding matrix), unless a quantization
        # scheme made one that the embedding reads its rows from (model/quantization/apply.py)
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings
                                          else Linear(config.hidden_size, local.vocab_size, self.backend))
        self.visual: Qwen3_5VisionTower | None = None  # Qwen3-VL's tower (model.visual.*), set by the loader
        self.image_cache = ImageEmbeddingCache()
        self.quantization: str | None = None  # the scheme's description, set by the loader

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def cache_specs(self) -> list[LayerCacheSpec]:
        """One spec per decoder layer (model/cache_spec.py): every Qwen3 layer attends, keeping K/V in pages
        (this rank's KV heads under tensor parallelism)."""
        return [PagedKVSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.model.layers]

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run every token of the batch, writing its K/V into `caches.kv`; -> (T, hidden) after the final norm."""
        kv_cache = caches.kv
        if kv_cache is None:
            raise ValueError("Qwen3 attends in every layer: it needs a KV cache")
        if kv_cache.dtype != self.dtype:  # index_copy_ would fail deep inside the first layer otherwise
            raise ValueError(f"KV cache dtype {kv_cache.dtype} differs from the model's {self.dtype}")
        image_embeds = step_image_embeddings(batch, self.visual, self.image_cache, self.config.architecture)
        return self.model(batch, kv_cache, image_embeds)

    def rotary_table(self) -> RotaryTable:
        """A table of (cos, signed_sin) by position, for building `ForwardBatch.rotary` ahead of a forward
        (which then skips computing them)."""
        return RotaryTable(self.model.rotary_emb, self.dtype)

    def compute_logits(self, hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) float32; computed in the weights' dtype like transformers.
        head_rows: rows of the LM head to use instead of it all (a draft's token map) -> (N, len(head_rows))."""
        if head_rows is not None:
            return self.backend.matmul(hidden, head_rows).float()
        if isinstance(self.lm_head, QuantizedLinear):  # quantized models run on one rank
            return self.lm_head(hidden).float()
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = self.backend.matmul(hidden, weight)  # (N, vocab slice)
        if self.parallel is not None:  # every rank's slice, the padding past the vocabulary cut off
            logits = self.parallel.all_gather_last(logits)[:, : self.config.vocab_size]
        return logits.float()

    def expert_load(self) -> dict[int, list[int]]:
        """{layer index: (token, expert) pairs routed to each expert since load} for every sparse layer."""
        return {index: layer.mlp.expert_load.tolist() for index, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)}

    def build_decode_stack(self) -> None:
        """Run decode-only steps through every layer in one compiled call, built by the backend's `decode_stack`
        from the weights (None: every step runs module by module). The stack rounds as the modules do only when
        they run the backend's sparse-MoE kernel too. Single-rank models only: the compiled stack has no
        collectives. Called once the backend is filled (model/backend_setup.py)."""
        self.model.decode_stack = None
        kernel = self.backend.decode_stack
        if kernel is None or self.parallel is not None:
            return
        norms: list[torch.Tensor] = []
        linears: list[PackedWeights] = []
        sparse: list[SparseMoeWeights | None] = []
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_layernorm.weight, attention.q_norm.weight, attention.k_norm.weight,
                      layer.post_attention_layernorm.weight]
            modules = [attention.qkv_proj, attention.o_proj]
            if isinstance(mlp, SparseMoeBlock):
                if self.backend.sparse_moe is None:  # the layer-by-layer path runs the torch experts: round alike
                    return
                sparse.append(SparseMoeWeights(mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                                               mlp.expert_load, mlp.gate.top_k, mlp.gate.normalize))
            else:
                modules += [mlp.gate_up_proj, mlp.down_proj]
                sparse.append(None)
            # fp8 projections (CUDA only) run module by module
            if not all(isinstance(module, (Linear, QuantizedLinear)) for module in modules):
                return
            linears += [module.packed for module in modules]
        embed = self.model.embed_tokens
        embedding = embed.packed if isinstance(embed, QuantizedEmbedding) else PackedWeights(16, embed.weight)
        attention = self.model.layers[0].self_attn
        self.model.decode_stack = kernel.decode_stack(embedding, norms, linears, sparse, attention.num_heads,
                                                      attention.num_kv_heads, attention.head_dim,
                                                      self.config.rms_norm_eps, attention.scale)

    @property
    def holds_packed_weights(self) -> bool:
        """Whether any projection holds int8/int4 weights (`QuantizedLinear`), which torch's ops multiply only
        after dequantizing the whole weight in float32 at every call (`reference_linear`)."""
        return any(isinstance(module, QuantizedLinear) for module in self.modules())
