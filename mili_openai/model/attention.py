"""Qwen3 self-attention: one fused q/k/v projection, per-head RMSNorm of q and k over head_dim *before*
RoPE (Qwen3's departure from Qwen2), grouped-query attention over the paged cache, output projection."""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.model.batch import ForwardBatch
from mili_openai.model.config import ModelConfig
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.layers import Linear, RMSNorm, rms_normalize
from mili_openai.model.paged_attention import paged_attention
from mili_openai.model.rope import apply_rotary


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = require_backend(backend)  # attention, fused_ops, matmul
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # rows: q_proj's, then k_proj's, then v_proj's (the loader concatenates them in this order)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, self.backend)
        self.o_proj = Linear(self.q_size, config.hidden_size, self.backend)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.backend)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """x (T, hidden); cos/sin (T, 1, D) from `RotaryEmbedding`; pools (slots, kv_heads, D) -> (T, hidden)."""
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads normalised and rotated together (fewer small ops per layer); each head keeps its
        # own norm weight, so this is q_norm(q) and k_norm(k) exactly
        qk = self._norm_and_rotate(qk.view(tokens, heads + kv_heads, self.head_dim), cos, sin)  # (T, H + KV, D)
        q, k = qk.split((heads, kv_heads), dim=1)  # (T, H, D), (T, KV, D)
        v = v.view(tokens, kv_heads, self.head_dim)  # (T, KV, D)
        out = paged_attention(q, k, v, k_pool, v_pool, batch, self.scale, self.backend.attention)  # (T, H, D)
        return self.o_proj(out.reshape(tokens, self.q_size))

    def _norm_and_rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kernel = self.backend.fused_ops
        if kernel is not None and kernel.supports_qk_norm_rope(qk):
            return kernel.qk_norm_rope(qk, self.q_norm.weight, self.k_norm.weight, self.num_heads,
                                                 self.q_norm.eps, cos, sin)
        norm_weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                                 self.k_norm.weight.expand(self.num_kv_heads, -1)))
        return apply_rotary(rms_normalize(qk, self.q_norm.eps) * norm_weight, cos, sin)
