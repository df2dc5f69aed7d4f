"""Leaf ops against transformers' own, bit for bit: RMSNorm and the RoPE rotation, in float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.layers import RMSNorm
from mili_openai.model.rope import apply_rotary

EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (7, 6, 32)])
def test_rms_norm_is_transformers_exactly_and_leaves_its_input(dtype, shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=generator)).to(dtype)
    ours, theirs = RMSNorm(shape[-1], EPS, KernelBackend()).to(dtype), Qwen3RMSNorm(shape[-1], EPS).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    before = x.clone()
    with torch.inference_mode():
        got, want = ours(x), theirs(x)
    assert torch.equal(x, before)  # normalising in place must not touch the residual stream
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_transformers_exactly(dtype):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    tokens, heads, dim = 9, 3, 16
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    angles = torch.randn(tokens, dim // 2, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # transformers' layout
    got = apply_rotary(x, full_cos[:, None], torch.cat((-sin, sin), -1)[:, None])
    # transformers: x (batch, heads, T, D) with cos (batch, T, D)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], full_cos[None], full_sin[None])
    assert torch.equal(got, want[0].transpose(0, 1))
