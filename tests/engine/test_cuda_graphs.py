"""Decode steps through `DecodeGraphs`' padded buckets. On the CPU it runs the padded batch eagerly, so
these tests check the padding without a GPU: padded rows and page table columns change no real row's
output and write no K/V but the scratch slot's. Capture and replay themselves run in tests/engine/test_cuda_path.py."""

from __future__ import annotations

import pytest
import torch

from hybrid_helpers import hybrid_caches, hybrid_tokens, with_state_slots
from model_helpers import PagedSequences, random_tokens

from mili_openai.engine.cuda_graphs import DecodeGraphs, capture_size
from mili_openai.kernels.lora import lora_groups
from mili_openai.model import KVCache, ModelCaches, load_model
from mili_openai.model.lora_adapter import load_lora_adapter
from mili_openai.model.lora_layers import LoraSlots

NUM_PAGES, PAGE_SIZE = 48, 4
SCRATCH_SLOT = NUM_PAGES * PAGE_SIZE  # the first slot of the one page past those handed out
PROMPTS = {"a": 9, "b": 30, "c": 17, "d": 5}
TABLE_WIDTH = 12  # pages of the longest context the graphs take (48 slots)
FP32_ATOL = 1e-5  # a padded batch is a taller matmul, which may sum in another order


def test_buckets():
    assert [capture_size(n) for n in (1, 2, 3, 4, 5, 9, 256)] == [1, 2, 4, 4, 8, 16, 256]
    assert capture_size(257) is None


@pytest.fixture(scope="module")
def model_and_config(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))


def prefilled(config, model) -> tuple[PagedSequences, KVCache]:
    """Every prompt prefilled, on the same shuffled pages each call (seeded)."""
    pages = PagedSequences(NUM_PAGES, PAGE_SIZE, seed=3)
    cache = KVCache(model.cache_specs(), NUM_PAGES + 1, PAGE_SIZE, torch.float32, torch.device("cpu"))
    for index, (key, length) in enumerate(PROMPTS.items()):
        pages.add(key, random_tokens(length + 8, seed=index))
        batch, _ = pages.batch(prefill=[(key, length)])
        model(batch, ModelCaches(cache))
    return pages, cache


@torch.inference_mode()
def test_padded_decode_matches_eager_and_writes_only_the_scratch_slot(model_and_config):
    model, config = model_and_config
    eager_pages, eager_cache = prefilled(config, model)
    graph_pages, graph_cache = prefilled(config, model)
    graphs = DecodeGraphs(model, graph_cache, SCRATCH_SLOT, TABLE_WIDTH)
    # four rows (bucket 4), then three in the same bucket: the fourth row's slots from the step before
    # must not be written again; then one row (bucket 1)
    steps = [["a", "b", "c", "d"], ["a", "b", "c", "d"], ["b", "c", "a"], ["c"], ["a", "d", "b"]]
    for keys in steps:
        eager_batch, _ = eager_pages.batch(decode=keys)
        graph_batch, _ = graph_pages.batch(decode=keys)
        bucket = graphs.bucket(graph_batch)
        assert bucket is not None
        expected = model(eager_batch, ModelCaches(eager_cache))
        got = graphs.run(graph_batch, bucket)
        torch.testing.assert_close(got, expected, rtol=0, atol=FP32_ATOL)
    assert set(graphs.graphs) == {4, 1} and graphs.steps_run == len(steps)
    real_slots = slice(0, SCRATCH_SLOT)
    torch.testing.assert_close(graph_cache.pools[:, :, real_slots], eager_cache.pools[:, :, real_slots],
                               rtol=0, atol=FP32_ATOL)
    assert graph_cache.pools[:, :, SCRATCH_SLOT].abs().sum() > 0  # the padded rows wrote there
    assert eager_cache.pools[:, :, SCRATCH_SLOT:].abs().sum() == 0


def test_only_decode_batches_within_the_buckets_run_from_graphs(model_and_config):
    model, config = model_and_config
    pages, cache = prefilled(config, model)
    graphs = DecodeGraphs(model, cache, SCRATCH_SLOT, TABLE_WIDTH)
    decode, _ = pages.batch(decode=["a"])
    assert graphs.bucket(decode) == 1
    mixed, _ = pages.batch(decode=["a"], prefill=[("b", 2)])
    assert graphs.bucket(mixed) is None  # a prefill chunk: eager
    prefill, _ = pages.batch(prefill=[("c", 3)])
    assert graphs.bucket(prefill) is None
    decode.rotary = model.model.rotary_emb(decode.positions, model.model.dtype)
    assert graphs.bucket(decode) is None  # rotary built ahead (the CPU path): eager
    decode.rotary = None
    decode.pages.decode = decode.pages.decode.new_zeros(1, TABLE_WIDTH + 1)
    assert graphs.bucket(decode) is None  # a context past the graphs' page tables
    with pytest.raises(ValueError, match="scratch slot"):
        DecodeGraphs(model, cache, cache.num_slots, TABLE_WIDTH)
    with pytest.raises(ValueError, match="page table width"):
        DecodeGraphs(model, cache, SCRATCH_SLOT, 0)


def test_capture_ahead_takes_every_bucket_up_to_the_limit_once(model_and_config):
    model, config = model_and_config
    _, cache = prefilled(config, model)
    graphs = DecodeGraphs(model, cache, SCRATCH_SLOT, TABLE_WIDTH)
    assert graphs.capture_ahead(max_rows=5) == 4  # rows 1, 2, 4, 8
    assert set(graphs.graphs) == {1, 2, 4, 8}
    assert graphs.capture_ahead(max_rows=5) == 0
    assert graphs.capture_ahead(max_rows=17) == 2  # 16 and 24


HYBRID_SLOTS = {"a": 0, "b": 1, "c": 2, "d": 3}
SCRATCH_STATE_SLOT = 4  # the state pool's last slot: past the running ones


def hybrid_prefilled(model) -> tuple[PagedSequences, ModelCaches]:
    """Every prompt prefilled on a Qwen3.5 model, each on its state slot (the same pages and states each call)."""
    pages = PagedSequences(NUM_PAGES, PAGE_SIZE, seed=3)
    caches = hybrid_caches(model, NUM_PAGES + 1, PAGE_SIZE, SCRATCH_STATE_SLOT + 1)
    for index, (key, length) in enumerate(PROMPTS.items()):
        pages.add(key, hybrid_tokens(length + 8, seed=index))
        batch, _ = pages.batch(prefill=[(key, length)])
        model(with_state_slots(batch, [], [(key, length)], HYBRID_SLOTS), caches)
    return pages, caches


@torch.inference_mode()
def test_hybrid_padded_decode_matches_eager_and_spoils_only_the_scratch_slots(hybrid_checkpoint):
    """A hybrid's decode rows carry their state slots into the bucket; padded rows run the scratch state slot,
    and every real slot's conv window and recurrent state end as eager decoding leaves them."""
    model, _ = load_model(hybrid_checkpoint("qwen3_5"), torch.float32, torch.device("cpu"), use_decode_kernel=False)
    eager_pages, eager_caches = hybrid_prefilled(model)
    graph_pages, graph_caches = hybrid_prefilled(model)
    graphs = DecodeGraphs(model, graph_caches.kv, SCRATCH_SLOT, TABLE_WIDTH, graph_caches.state, SCRATCH_STATE_SLOT)
    for keys in [["a", "b", "c"], ["d", "b", "a"], ["c"], ["a", "d", "b", "c"], ["b", "a"]]:
        eager_batch = with_state_slots(eager_pages.batch(decode=keys)[0], keys, [], HYBRID_SLOTS)
        graph_batch = with_state_slots(graph_pages.batch(decode=keys)[0], keys, [], HYBRID_SLOTS)
        bucket = graphs.bucket(graph_batch)
        assert bucket is not None
        torch.testing.assert_close(graphs.run(graph_batch, bucket), model(eager_batch, eager_caches), rtol=0,
                                   atol=FP32_ATOL)
    real = slice(0, SCRATCH_STATE_SLOT)
    for graph_pool, eager_pool in ((graph_caches.state.conv, eager_caches.state.conv),
                                   (graph_caches.state.recurrent, eager_caches.state.recurrent)):
        torch.testing.assert_close(graph_pool[:, real], eager_pool[:, real], rtol=0, atol=FP32_ATOL)
        assert graph_pool[:, SCRATCH_STATE_SLOT].abs().sum() > 0  # the padded rows ran there
        assert eager_pool[:, SCRATCH_STATE_SLOT].abs().sum() == 0
    # a step verifying drafts runs its rows depth by depth over one slot: eager
    verifying = with_state_slots(graph_pages.batch(decode=["a", "b"])[0], ["a", "b"], [], HYBRID_SLOTS)
    verifying.decode_groups = [1, 1]
    assert graphs.bucket(verifying) is None
    # a hybrid's rows without a scratch state slot to pad them with: eager
    assert DecodeGraphs(model, graph_caches.kv, SCRATCH_SLOT, TABLE_WIDTH).bucket(verifying) is None
    with pytest.raises(ValueError, match="scratch state slot"):
        DecodeGraphs(model, graph_caches.kv, SCRATCH_SLOT, TABLE_WIDTH, graph_caches.state, SCRATCH_STATE_SLOT + 1)


@torch.inference_mode()
def test_lora_padded_decode_matches_eager(tiny_checkpoint, lora_adapters):
    """Adapters served: a bucket's static row blocks take each step's groups (padded rows on the base), and the
    bucket's rows come out as eager decoding with the same adapters gives them, steps with no adapter row too."""
    model, config = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))  # its own: slots wrap it
    slots = LoraSlots(model, num_slots=2, max_rank=64)
    for slot, name in enumerate(("r8", "r64")):
        slots.load(slot, load_lora_adapter(name, lora_adapters[name], slots.shapes, 64))
    eager_pages, eager_cache = prefilled(config, model)
    graph_pages, graph_cache = prefilled(config, model)
    graphs = DecodeGraphs(model, graph_cache, SCRATCH_SLOT, TABLE_WIDTH, lora=slots)
    steps = [(["a", "b", "c"], [0, 1, -1]), (["a", "b", "c", "d"], [1, 1, 0, 1]), (["b", "c"], [-1, -1]),
             (["d"], [0])]
    for keys, row_slots in steps:
        groups = lora_groups(row_slots, torch.device("cpu"))
        eager_batch, _ = eager_pages.batch(decode=keys)
        graph_batch, _ = graph_pages.batch(decode=keys)
        with slots.rows(groups):
            expected = model(eager_batch, ModelCaches(eager_cache))
        got = graphs.run(graph_batch, graphs.bucket(graph_batch), groups)
        torch.testing.assert_close(got, expected, rtol=0, atol=FP32_ATOL)
    assert set(graphs.graphs) == {4, 2, 1} and all(entry.lora_rows is not None for entry in graphs.graphs.values())
