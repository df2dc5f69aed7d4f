"""The full-attention layer of Qwen3.5 / Qwen3-Next: Qwen3's attention with an output gate.

`q_proj` yields, per query head, head_dim query rows then head_dim gate rows (transformers views its output as
(heads, 2 * head_dim) and chunks the last dim); the attention output is multiplied by sigmoid(gate) before
`o_proj`. q and k get zero-centred RMSNorms over head_dim, then RoPE on their leading `rotary_dim` dims only
(partial_rotary_factor; with text positions mRoPE is exactly this, see model/hybrid_config.py). K/V go to
the paged pool through the same attention paths as Qwen3's.
"""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.model.batch import ForwardBatch
from mili_openai.model.config import ModelConfig
from mili_openai.model.hybrid_norms import ZeroCenteredRMSNorm
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.layers import Linear
from mili_openai.model.paged_attention import paged_attention
from mili_openai.model.rope import apply_partial_rotary

QUERY_AND_GATE = 2  # q_proj's rows per head: the query's, then the gate's


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = require_backend(backend)  # attention, matmul
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # rows: q_proj's (query and gate interleaved per head), then k_proj's, then v_proj's (the loader's order)
        self.qkv_proj = Linear(config.hidden_size, QUERY_AND_GATE * self.q_size + 2 * self.kv_size, self.backend)
        self.o_proj = Linear(self.q_size, config.hidden_size, self.backend)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, self.backend)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, self.backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """x (T, hidden); cos/sin (T, 1, rotary_dim); pools (slots, kv_heads, D) -> (T, hidden)."""
        tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split((QUERY_AND_GATE * self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, gate = query_gate.view(tokens, self.num_heads, QUERY_AND_GATE * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), cos, sin)  # (T, H, D)
        k = apply_partial_rotary(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        out = paged_attention(q, k, v, k_pool, v_pool, batch, self.scale, self.backend.attention)  # (T, H, D)
        gated = out.reshape(tokens, self.q_size) * torch.sigmoid(gate.reshape(tokens, self.q_size))
        return self.o_proj(gated)
