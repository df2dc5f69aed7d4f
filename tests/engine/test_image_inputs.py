"""Where a request's images sit and how their tokens are positioned: mRoPE positions equal transformers'
`Qwen3_5Model.get_rope_index` (the oracle) for prompts with several images of different grids; the rotary of three
position streams equals transformers' `Qwen3_5TextRotaryEmbedding`, and plain RoPE where the streams agree; a
step's image rows and embedding slices follow chunk boundaries that cut through images; prefix-cache keys hold each
image's digest (the same image shares pages, another parts at its first placeholder); the scheduler spreads a request's images over steps under the encoder
budget while another sequence decodes every step."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mili_openai.config import EngineConfig
from mili_openai.engine.encoder_budget import EncoderBudget
from mili_openai.engine.image_batch import vision_batch
from mili_openai.engine.image_inputs import ImageFeatures, place_images
from mili_openai.engine.image_processor import expand_image_placeholders
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.scheduler import Scheduler
from mili_openai.engine.sequence import Sequence
from mili_openai.model.vision_batch import mrope_pair_streams, mrope_rotary

IMAGE_TOKEN, START, END = 900, 901, 902
MERGE = 2
GRIDS = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]


def features(grid: tuple[int, int, int], seed: int) -> ImageFeatures:
    patches = grid[0] * grid[1] * grid[2]
    return ImageFeatures(np.full((patches, 4), seed, dtype=np.float32), grid, MERGE, f"image-{seed}")


def prompt_with(images: list[ImageFeatures]) -> list[int]:
    ids = [1, 2, 3]
    for index, _ in enumerate(images):
        ids += [START, IMAGE_TOKEN, END] + [10 + index] * (index + 2)
    return expand_image_placeholders(ids, images, IMAGE_TOKEN)


def transformers_rope_index(ids: list[int], images: list[ImageFeatures]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Qwen3_5Model

    owner = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
                            get_vision_position_ids=functools.partial(Qwen3_5Model.get_vision_position_ids, None))
    inputs = torch.tensor([ids])
    return Qwen3_5Model.get_rope_index(owner, inputs, (inputs == IMAGE_TOKEN).int(),
                                       image_grid_thw=torch.tensor([image.grid_thw for image in images]))


def test_positions_match_transformers_get_rope_index():
    images = [features(grid, seed) for seed, grid in enumerate(GRIDS)]
    ids = prompt_with(images)
    placed = place_images(ids, IMAGE_TOKEN, images)
    positions, delta = transformers_rope_index(ids, images)
    assert np.array_equal(placed.positions, positions[:, 0].numpy())
    assert placed.delta == int(delta)
    runs = [i for i, token in enumerate(ids) if token == IMAGE_TOKEN and ids[i - 1] != IMAGE_TOKEN]
    assert placed.starts == tuple(runs)
    # decode tokens continue at index + delta on every stream, as transformers' cached rope_deltas
    after = placed.positions_of(len(ids) - 2, 4)
    assert after[:, :2].tolist() == placed.positions[:, -2:].tolist()
    assert after[:, 2:].tolist() == [[len(ids) + delta, len(ids) + 1 + delta]] * 3


def test_placeholder_mismatches_are_refused():
    images = [features(GRIDS[0], 0)]
    with pytest.raises(ValueError, match="placeholders"):
        expand_image_placeholders([1, IMAGE_TOKEN, IMAGE_TOKEN], images, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="needs"):
        place_images([1, IMAGE_TOKEN, 2], IMAGE_TOKEN, images)
    with pytest.raises(ValueError, match="places 0"):
        place_images([1, 2], IMAGE_TOKEN, images)


def test_mrope_rotary_matches_transformers():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, head_dim=32, rope_parameters=dict(
        rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5, mrope_section=[3, 3, 2],
        mrope_interleaved=True))
    reference = Qwen3_5TextRotaryEmbedding(config)
    images = [features(grid, seed) for seed, grid in enumerate(GRIDS)]
    positions = torch.from_numpy(place_images(prompt_with(images), IMAGE_TOKEN, images).positions)
    cos_ref, sin_ref = reference(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    streams = mrope_pair_streams((3, 3, 2), 8)
    cos, signed_sin = mrope_rotary(positions, reference.inv_freq, 1.0, streams, torch.float32)
    assert torch.equal(cos[:, 0], cos_ref[0])
    assert torch.equal(signed_sin[:, 0, 8:], sin_ref[0, :, 8:]) and torch.equal(signed_sin[:, 0, :8], -sin_ref[0, :, :8])


def sequence(ids: list[int], images=None) -> Sequence:
    from mili_openai.engine.sampling_params import SamplingParams

    seq = Sequence("s", ids, SamplingParams(max_tokens=4), 4, 0.0, detokenizer=None, stop_matcher=None,
                   generator=None)
    seq.images = images
    return seq


def test_step_rows_follow_chunks_through_images():
    images = [features(grid, seed) for seed, grid in enumerate(GRIDS)]
    ids = prompt_with(images)
    placed = place_images(ids, IMAGE_TOKEN, images)
    with_images, text = sequence(ids, placed), sequence([5, 6, 7, 8])
    cuts = [0, 7, 16, 22, len(ids)]  # 7 and 16 fall inside the first and second images
    embedded_rows = []
    for start, end in zip(cuts, cuts[1:]):
        batch = ScheduledBatch([text, with_images], [1, end - start], [3, start], num_decode=1, samples=[True, True])
        step = vision_batch(batch)
        assert step.positions[:, 0].tolist() == [3, 3, 3]
        assert torch.equal(step.positions[:, 1:], torch.from_numpy(placed.positions[:, start:end]))
        rows = step.rows.tolist()
        assert [ids[start + row - 1] for row in rows] == [IMAGE_TOKEN] * len(rows)
        assert sum(piece.end - piece.start for piece in step.pieces) == len(rows)
        embedded_rows += [(piece.digest, i) for piece in step.pieces for i in range(piece.start, piece.end)]
    assert embedded_rows == [(image.digest, i) for image in images for i in range(image.num_tokens)]
    assert vision_batch(ScheduledBatch([text], [1], [3], num_decode=1, samples=[True])) is None


def placed(ids: list[int], images, lora_id: int = 0) -> Sequence:
    seq = sequence(ids, None if images is None else place_images(ids, IMAGE_TOKEN, images))
    seq.lora_id = lora_id
    return seq


def run_and_cache(pages: KVPageManager, seq: Sequence) -> None:
    """seq runs its whole prompt, hands its full pages to the tree and finishes."""
    pages.match(seq)
    assert pages.allocate(seq, pages.pages_needed(seq, seq.num_tokens - seq.num_computed_tokens))
    seq.num_computed_tokens = seq.num_tokens
    pages.release(seq)


def matched(pages: KVPageManager, seq: Sequence) -> int:
    """The prompt tokens seq finds cached (then it lets them go)."""
    found = pages.match(seq)
    pages.release(seq)
    return found


def test_prefix_cache_keys_hold_the_images():
    """The same image shares pages past it; another image, the same ids without images, or another adapter part
    at the image's first placeholder (whole pages before it are still shared)."""
    pages = KVPageManager(num_pages=64, page_size=2, enable_prefix_caching=True)
    images = [features(GRIDS[2], 0), features(GRIDS[0], 1)]
    ids = prompt_with(images)
    first_image, second_image = (i for i, token in enumerate(ids) if token == IMAGE_TOKEN and ids[i - 1] == START)
    run_and_cache(pages, placed(ids, images))
    assert matched(pages, placed(ids, images)) == (len(ids) - 1) // 2 * 2  # the last page before the last token
    other_pixels = features(GRIDS[2], 2)  # the same grid (so the same ids), other pixels
    assert matched(pages, placed(ids, [other_pixels, images[1]])) == first_image // 2 * 2
    assert matched(pages, placed(ids, None)) == first_image // 2 * 2  # the placeholder ids alone match no image
    assert matched(pages, placed(ids, [images[0], features(GRIDS[0], 3)])) == second_image // 2 * 2
    assert matched(pages, placed(ids, images, lora_id=1)) == 0  # an adapter shifts the text too
    run_and_cache(pages, placed(ids, images, lora_id=1))
    assert matched(pages, placed(ids, images, lora_id=1)) == (len(ids) - 1) // 2 * 2
    pages.check_integrity([])


def image_starts_in(seq: Sequence, start: int, count: int) -> int:
    return sum(start <= first < start + count for first in seq.images.starts)


@pytest.mark.parametrize("max_patches, images_per_step", [
    (10_000, 4),  # every image in the first step
    (40, 2),  # two 16-patch images a step
    (8, 1),  # below one image: still one a step
])
def test_encoder_budget_spreads_images_while_decodes_keep_stepping(max_patches, images_per_step):
    images = [features((1, 4, 4), seed) for seed in range(4)]  # 16 patches, 4 tokens each
    ids = prompt_with(images)
    config = EngineConfig(page_size=4, num_pages=64, max_num_seqs=8, max_num_batched_tokens=512,
                          max_encoder_patches_per_step=max_patches)
    scheduler = Scheduler(config, KVPageManager(num_pages=64, page_size=4, enable_prefix_caching=True))
    decoding = sequence([5, 6, 7, 8])
    decoding.max_tokens = 100
    scheduler.add(decoding)
    scheduler.schedule()
    decoding.append_token(1)
    with_images = sequence(ids, place_images(ids, IMAGE_TOKEN, images))
    scheduler.add(with_images)
    encoded = []
    while with_images.num_computed_tokens < len(ids):
        batch = scheduler.schedule()
        assert batch.seqs[0] is decoding and batch.num_decode == 1  # the decode runs in every step
        decoding.append_token(1)
        if with_images in batch.seqs:
            index = batch.seqs.index(with_images)
            encoded.append(image_starts_in(with_images, batch.positions[index], batch.num_new_tokens[index]))
    assert max(encoded) == images_per_step and sum(encoded) == len(images)
    assert len([n for n in encoded if n]) == -(-len(images) // images_per_step)


def test_a_chunk_resuming_inside_an_image_is_charged_for_it():
    """A prefix hit may end inside an image: the first chunk after admission encodes that image, so it takes
    encoder budget; a later chunk of a running sequence inside the same image does not (its first chunk did)."""
    images = [features((1, 4, 4), seed) for seed in range(2)]  # 16 patches, 4 tokens each
    ids = prompt_with(images)
    first, resumed = (sequence(ids, place_images(ids, IMAGE_TOKEN, images)) for _ in range(2))
    budget = EncoderBudget(max_patches=16)
    assert budget.limit(first, len(ids)) == first.images.starts[1]  # the second image waits for the next step
    resumed.num_computed_tokens = resumed.images.starts[0] + 2
    assert budget.limit(resumed, 1, admitted=True) == 0
    assert budget.limit(resumed, 1) == 1
    assert EncoderBudget(max_patches=16).limit(resumed, 1, admitted=True) == 1  # a step's first image is taken
