"""The vision side of Qwen3.5 and Qwen3-VL against transformers on random vision-language checkpoints written by
transformers itself: the image preprocessing gives exactly the pixel values and grids of the checkpoint's own image
processor (`AutoImageProcessor`), and mili's vision tower (model/qwen3_5_vision.py, loaded from `model.visual.*`)
gives transformers' `Qwen3_5VisionModel` merged embeddings (and `Qwen3VLVisionModel`'s DeepStack features too) in
fp32, its projections on oneDNN, on the AVX2 set's fused GEMM and on torch's matmul, for images of several sizes and aspect ratios encoded together (each attending to its own patches only).
Unsupported vision options are refused at load, by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vision_helpers import IMAGE_SIZES, drawn_image

from mili_openai.engine.image_processor import ImagePreprocessor
from mili_openai.kernels import cpu_avx2
from mili_openai.model.hybrid_checkpoint import TINY_VISION_CONFIG
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.loader import load_model
from mili_openai.model.qwen3_5_vision import GRID_TABLES_CACHED, Qwen3_5VisionTower, attention_per_image, rotate_pairs
from mili_openai.model.vision_config import DEFAULT_VISION, VisionTowerConfig, read_vision_spec, read_vision_tower

EMBEDDING_ATOL = 1e-5


# model line -> transformers' class
REFERENCE_CLASSES = {"qwen3_5_vl": "Qwen3_5ForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(REFERENCE_CLASSES))
def checkpoint(request, hybrid_checkpoint):
    if request.param == "qwen3_vl":
        return request.getfixturevalue("qwen3_vl_checkpoint")
    return hybrid_checkpoint(request.param)


@pytest.fixture(scope="module")
def features(checkpoint):
    spec = read_vision_spec(checkpoint, json.loads((checkpoint / "config.json").read_text()))
    preprocess = ImagePreprocessor(spec)
    return [preprocess(drawn_image(width, height, seed)) for seed, (width, height) in enumerate(IMAGE_SIZES)]


def test_preprocessing_equals_the_checkpoint_image_processor(checkpoint, features):
    from transformers import AutoImageProcessor

    reference = AutoImageProcessor.from_pretrained(str(checkpoint))
    images = [drawn_image(width, height, seed) for seed, (width, height) in enumerate(IMAGE_SIZES)]
    out = reference(images=images, return_tensors="np")
    assert np.array_equal(np.concatenate([f.pixel_values for f in features]), out["pixel_values"])
    assert [list(f.grid_thw) for f in features] == out["image_grid_thw"].tolist()
    assert [f.num_tokens for f in features] == [t * h * w // 4 for t, h, w in out["image_grid_thw"].tolist()]
    assert len({f.digest for f in features}) == len(features)


def test_vision_tower_matches_transformers(checkpoint, features):
    import transformers

    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    reference_class = getattr(transformers, REFERENCE_CLASSES["qwen3_vl" if config.vision else "qwen3_5_vl"])
    reference = reference_class.from_pretrained(str(checkpoint), dtype=torch.float32)
    pixel_values = torch.cat([torch.from_numpy(f.pixel_values) for f in features])
    grids = [f.grid_thw for f in features]
    with torch.no_grad():
        out = reference.model.visual(pixel_values, grid_thw=torch.tensor(grids))
        deepstack = getattr(out, "deepstack_features", None) or []
        expected = torch.stack([out.pooler_output, *deepstack], dim=1)  # (tokens, 1 + DeepStack layers, hidden)
        got = model.visual.encode([torch.from_numpy(f.pixel_values) for f in features], grids)
    assert len(deepstack) == len(config.vision_tower.deepstack_visual_indexes)
    assert [g.shape[0] for g in got] == [f.num_tokens for f in features]
    torch.testing.assert_close(torch.cat(got), expected, atol=EMBEDDING_ATOL, rtol=0)
    # one image alone gives its rows of the batch: attention stays within each image
    with torch.no_grad():
        alone = model.visual.encode([torch.from_numpy(features[1].pixel_values)], [features[1].grid_thw])[0]
    torch.testing.assert_close(alone, got[1], atol=EMBEDDING_ATOL, rtol=0)
    # the projections ran on oneDNN's packed linears (bias and GELU fused); the AVX2 set's fused GEMM (a CPU
    # without AVX-512's) and torch's matmul path give the same
    assert model.backend.biased_linear is not None
    avx2 = cpu_avx2.compiled_avx2_kernels() if cpu_avx2.cpu_supports_avx2_kernels() else None
    for kernel in ([avx2.biased_linear] if avx2 is not None else []) + [None]:
        model.backend.biased_linear = kernel
        with torch.no_grad():
            again = model.visual.encode([torch.from_numpy(f.pixel_values) for f in features], grids)
        torch.testing.assert_close(torch.cat(again), expected, atol=EMBEDDING_ATOL, rtol=0)


def test_bf16_tower_computes_in_fp32_where_the_cpu_has_no_bf16_arithmetic(hybrid_checkpoint, features,
                                                                          monkeypatch):
    """Where oneDNN has no bf16 (AVX2 CPUs), a bf16 checkpoint's tower runs in fp32 on the same (bf16-valued)
    weights and hands the language model bf16 embeddings: those of the fp32 computation, rounded once."""
    from mili_openai.model import backend_setup

    checkpoint = hybrid_checkpoint("qwen3_5_vl")
    pixel_values, grids = [torch.from_numpy(f.pixel_values) for f in features], [f.grid_thw for f in features]
    monkeypatch.setattr(backend_setup, "bf16_supported", lambda: False)
    widened, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"), use_decode_kernel=False)
    assert widened.visual.dtype == torch.float32 and widened.model.dtype == torch.bfloat16
    monkeypatch.setattr(backend_setup, "bf16_supported", lambda: True)
    native, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"), use_decode_kernel=False)
    assert native.visual.dtype == torch.bfloat16
    with torch.no_grad():
        got = torch.cat(widened.visual.encode(pixel_values, grids))
        in_bf16 = torch.cat(native.visual.encode(pixel_values, grids)).float()
        native.visual.compute_in(torch.float32)  # the same weights, widened: the fp32 computation
        in_fp32 = torch.cat(native.visual.encode(pixel_values, grids))
    assert got.dtype == in_fp32.dtype == torch.bfloat16
    scale = float(in_fp32.float().abs().max())
    torch.testing.assert_close(got.float(), in_fp32.float(), rtol=0, atol=1e-2 * scale)  # one bf16 rounding apart
    assert float((got.float() - in_bf16).abs().max()) > 0  # the bf16 computation rounds along the way


def test_attention_per_image_batches_frames_of_one_size():
    """Runs of frames of one size go through SDPA together; each frame still attends to its own patches only."""
    generator = torch.Generator().manual_seed(0)
    lengths, heads, head_dim = [4, 4, 6, 4, 4], 2, 8
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, generator=generator) for _ in range(3))
    expected = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) / head_dim ** 0.5, dim=-1)
        expected.append(torch.einsum("hqk,khd->qhd", weights, vs))
    torch.testing.assert_close(attention_per_image(q, k, v, lengths), torch.cat(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rounds_as_transformers(dtype):
    """rotate_pairs is transformers' apply_rotary_pos_emb_vision bit for bit (in float32, then back to dtype)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

    generator = torch.Generator().manual_seed(0)
    qk = torch.randn(2, 10, 3, 16, generator=generator).to(dtype)
    angles = torch.randn(10, 8, generator=generator)
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()
    q, k = apply_rotary_pos_emb_vision(qk[0], qk[1], cos, sin)
    assert torch.equal(rotate_pairs(qk, cos, sin), torch.stack((q, k)))


def test_grid_tables_are_kept_per_size_and_dropped_with_the_weights_dtype():
    tower = Qwen3_5VisionTower(VisionTowerConfig(**(DEFAULT_VISION | TINY_VISION_CONFIG), out_hidden_size=8),
                               KernelBackend())
    grid = (1, 4, 6)
    first = tower.grid_tables(grid)
    assert tower.grid_tables(grid)[0] is first[0]  # kept
    for columns in range(GRID_TABLES_CACHED):  # as many other sizes, each newer than it
        tower.grid_tables((1, 2, 2 * (columns + 1)))
    assert tower.grid_tables(grid)[0] is not first[0]  # dropped, made again
    torch.testing.assert_close(tower.grid_tables(grid), first, rtol=0, atol=0)
    tower.to(torch.float64)
    assert tower.grid_tables(grid)[0].dtype == torch.float64


@pytest.mark.parametrize("vision_config, message", [
    (dict(deepstack_visual_indexes=[1]), "DeepStack"),
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn")), "rope type"),
])
def test_unsupported_vision_options_are_refused(vision_config, message):
    with pytest.raises(NotImplementedError, match=message):
        read_vision_tower({"vision_config": dict(hidden_size=32, num_heads=2, out_hidden_size=64) | vision_config}, 64)
