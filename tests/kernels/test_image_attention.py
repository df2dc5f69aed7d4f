"""The vision tower's attention on the CPU prefill kernel (kernels/cpu_image_attention.py): each frame's queries
folded into one-row chunks of grouped query heads and back, and the kernel's result against each frame's own
softmax attention; where it declines (fp32, AMX tiles, no AVX512-BF16) torch's SDPA runs instead."""

from __future__ import annotations

import pytest
import torch

from mili_openai.kernels import cpu_supports_kernels
from mili_openai.kernels.cpu import ATTENTION_HEAD_DIMS
from mili_openai.kernels.cpu_image_attention import MAX_GROUP, CpuImageAttention, fold_queries, unfold_outputs
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.qwen3_5_vision import Qwen3_5VisionTower, attention_per_image
from mili_openai.model.vision_config import DEFAULT_VISION, VisionTowerConfig

BF16_TOLERANCE = 2e-2
HEADS, HEAD_DIM = 2, 64
# patches per frame: under one chunk, exactly one, one and a bit (a padded last chunk), several
FRAME_LENGTHS = (6, MAX_GROUP, MAX_GROUP + 1, 3 * MAX_GROUP - 5)


def chunking(length: int) -> tuple[int, int, int]:
    """(chunks, group, full) as CpuImageAttention.attend cuts a frame of `length` patches."""
    chunks = -(-length // MAX_GROUP)
    group = -(-length // chunks)
    return chunks, group, length // group


@pytest.mark.parametrize("length", FRAME_LENGTHS)
def test_folding_round_trips_and_places_each_patch_as_a_query_head(length):
    frames = 3
    q = torch.randn(frames, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(length))
    chunks, group, full = chunking(length)
    folded = fold_queries(q, chunks, group, full)
    assert folded.shape == (frames, chunks, HEADS, group, HEAD_DIM) and group <= MAX_GROUP
    patch = length - 1  # the last one: in the padded chunk where there is one
    assert torch.equal(folded[2, patch // group, 1, patch % group], q[2, patch, 1])
    assert not folded.view(frames, -1, HEAD_DIM).isnan().any()  # padding queries are zeros
    assert torch.equal(unfold_outputs(folded, length, full), q)


class StandIn:
    """The compiled kernels as CpuImageAttention sees them, the CPU's capabilities set by the test."""

    def __init__(self, kernels, bf16_dot_products: bool = True, amx_tiles: bool = False) -> None:
        self.paged_prefill_attention = kernels.paged_prefill_attention
        self.bf16_dot_products, self.amx_tiles = bf16_dot_products, amx_tiles


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each frame's softmax attention over its own rows, in float64."""
    out = []
    for qs, ks, vs in zip(*(t.double().split(lengths) for t in (q, k, v))):
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) / qs.shape[-1] ** 0.5, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, vs))
    return torch.cat(out)


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
def test_image_attention_on_the_kernel_matches_each_frames_attention(kernels):
    lengths = [FRAME_LENGTHS[2]] * 2 + [FRAME_LENGTHS[0]] + [FRAME_LENGTHS[3]] * 3  # runs of equal frames
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(3))
    kernel = CpuImageAttention(StandIn(kernels), ATTENTION_HEAD_DIMS)
    got = attention_per_image(q, k, v, lengths, kernel)
    torch.testing.assert_close(got.double(), frame_attention(q, k, v, lengths), atol=BF16_TOLERANCE, rtol=0)
    assert kernel.attend(q[:6], k[:6], v[:6], 1) is not None  # the kernel ran, not the SDPA fallback


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
@pytest.mark.parametrize("dtype, capabilities", [
    (torch.float32, {}),  # torch's flash SDPA is faster in fp32
    (torch.bfloat16, dict(amx_tiles=True)),  # and on AMX tiles
    (torch.bfloat16, dict(bf16_dot_products=False)),  # and without AVX512-BF16's pair products
])
def test_image_attention_declines_where_torch_is_faster(kernels, dtype, capabilities):
    q = torch.randn(8, HEADS, HEAD_DIM).to(dtype)
    assert CpuImageAttention(StandIn(kernels, **capabilities), ATTENTION_HEAD_DIMS).attend(q, q, q, 1) is None
    torch.testing.assert_close(attention_per_image(q, q, q, [8], CpuImageAttention(StandIn(kernels, **capabilities),
                                                                                    ATTENTION_HEAD_DIMS)),
                               frame_attention(q, q, q, [8]).to(dtype), atol=BF16_TOLERANCE, rtol=0)


@pytest.mark.skipif(not cpu_supports_kernels(), reason="this CPU has no AVX512")
def test_a_bf16_tower_on_the_kernel_encodes_as_on_torch_sdpa(kernels):
    """The tower's own q, k, v (rotated, strided views of its qkv projection) through the kernel: the same
    embeddings as torch's SDPA gives, to bf16 rounding, for two image sizes encoded together."""
    config = VisionTowerConfig(**(DEFAULT_VISION | dict(depth=1, hidden_size=128, intermediate_size=256,
                                                        num_heads=2)), out_hidden_size=64)
    torch.manual_seed(0)
    plain = Qwen3_5VisionTower(config, KernelBackend())
    for parameter in plain.parameters():
        parameter.data.normal_(0, 0.05)
    plain = plain.to(torch.bfloat16)
    backend = KernelBackend(image_attention=CpuImageAttention(StandIn(kernels), ATTENTION_HEAD_DIMS))
    on_kernel = Qwen3_5VisionTower(config, backend).to(torch.bfloat16)
    on_kernel.load_state_dict(plain.state_dict())
    grids = [(1, 10, 14), (1, 4, 4)]  # 140 patches (three chunks, the last padded) and 16
    pixel_values = [torch.randn(t * h * w, config.patch_dim) for t, h, w in grids]
    with torch.inference_mode():
        expected, got = (torch.cat(tower.encode(pixel_values, grids)).float() for tower in (plain, on_kernel))
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=BF16_TOLERANCE * scale, rtol=0)
