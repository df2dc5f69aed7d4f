"""The Triton paged attention kernels against their torch reference, and the engine through them.

Not collected by the suite itself (no `test_` prefix): tests/kernels/test_triton_interpreted.py runs this file in a
subprocess with TRITON_INTERPRET=1, where Triton runs the kernels on CPU tensors; the variable must be set
before Triton is imported and stays for the whole process, so it cannot share one with other tests. On a
GPU machine run it directly (`pytest tests/kernels/triton_attention_cases.py`): the same cases on CUDA.

Shapes stay small: the interpreter runs every program of a launch in Python.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_matches, greedy, hf_greedy, load_hf, random_prompts
from model_helpers import PagedSequences, random_tokens

pytest.importorskip("triton")

from mili_openai import LLM  # noqa: E402
from mili_openai.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from mili_openai.engine.memory_profile import dummy_prefill_batch  # noqa: E402
from mili_openai.engine.step_inputs import map_tensors  # noqa: E402
from mili_openai.kernels.attention_reference import (  # noqa: E402
    paged_decode_reference,
    paged_prefill_reference,
)
from mili_openai.kernels.triton_attention import ExtendConfig, TritonAttention  # noqa: E402
from mili_openai.model import KVCache, ModelCaches, load_model  # noqa: E402
from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment  # noqa: E402
from mili_openai.model.paged_attention import paged_attention  # noqa: E402

BACKEND = TritonAttention()
DEVICE = torch.device(BACKEND.device_type)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton compiles for CUDA here and torch sees no GPU (set TRITON_INTERPRET=1 to run on the CPU)",
                allow_module_level=True)

PAGE_SIZE = 16
NUM_PAGES = 160  # 2560 slots: room for a 1000+ token context and a few short ones, on shuffled pages
CONTEXTS = [1, 15, 16, 17, 1030]  # a page boundary either side, and a long context over many pages
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
GQA_SHAPES = [(2, 2), (4, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 2 and 8


def pools(kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES * PAGE_SIZE, kv_heads, head_dim)
    return tuple(torch.randn(shape, generator=generator).to(dtype).to(DEVICE) for _ in range(2))


def page_tables(lengths: list[int], seed: int) -> torch.Tensor:
    """(len(lengths), W): disjoint random pages for each context, zero-padded."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_PAGES, generator=generator)
    needed = [-(-length // PAGE_SIZE) for length in lengths]
    table = torch.zeros(len(lengths), max(needed), dtype=torch.int64)
    start = 0
    for row, count in enumerate(needed):
        table[row, :count] = order[start : start + count]
        start += count
    return table.to(DEVICE)


def queries(rows: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, head_dim, generator=generator).to(dtype).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOLERANCE[got.dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", GQA_SHAPES)
def test_decode_matches_the_reference(heads, kv_heads, head_dim):
    k_pool, v_pool = pools(kv_heads, head_dim, torch.float32, seed=1)
    table = page_tables(CONTEXTS, seed=2)
    ctx_lens = torch.tensor(CONTEXTS, device=DEVICE)
    q = queries(len(CONTEXTS), heads, head_dim, torch.float32, seed=3)
    scale = head_dim ** -0.5
    want = paged_decode_reference(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens, scale)
    assert BACKEND.decode_splits(len(CONTEXTS), kv_heads) > 1  # the long context is split, then reduced
    assert_close(BACKEND.paged_decode_attention(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens, scale), want)
    # one split: the partial kernel writes the output itself, no reduce
    assert_close(BACKEND.paged_decode_attention(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens, scale,
                                                num_splits=1), want)


def test_decode_in_bfloat16_and_into_a_strided_output():
    heads, kv_heads, head_dim = 4, 2, 64
    k_pool, v_pool = pools(kv_heads, head_dim, torch.bfloat16, seed=4)
    table = page_tables(CONTEXTS, seed=5)
    ctx_lens = torch.tensor(CONTEXTS, device=DEVICE)
    qk = queries(len(CONTEXTS), heads + kv_heads, head_dim, torch.bfloat16, seed=6)
    q = qk[:, :heads]  # rows apart, as the model's q is a view of its fused q/k projection
    out = torch.full((len(CONTEXTS) + 2, heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    BACKEND.paged_decode_attention(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens, 0.125, out=out[1:-1])
    assert_close(out[1:-1], paged_decode_reference(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens, 0.125))
    assert out[0].isnan().all() and out[-1].isnan().all()  # nothing written outside the view


# (cached prefix, new tokens) per segment: whole prompts, chunks across page edges, a radix hit over several
# key blocks ending mid-page and mid-block (213 = 3 x 64 + 21: 1013 did the same at 40% more interpreter time);
# against the extend kernel's key blocks (64 positions): a prompt of several token blocks (unmasked key blocks
# behind the later ones), a prefix ending mid-page and mid-block before a chunk of several blocks, a chunk
# shorter than a block right at a block edge, and a hit on the whole prompt but its last token, the prefix
# ending on a block edge (every earlier key unmasked, a diagonal block of one)
SEGMENTS = [(0, 1), (0, 17), (15, 1), (16, 16), (213, 20), (3, 37), (0, 150), (37, 90), (64, 5), (128, 1)]


def check_varlen_prefill(backend: TritonAttention, heads: int, kv_heads: int, head_dim: int,
                         dtype: torch.dtype = torch.float32) -> None:
    k_pool, v_pool = pools(kv_heads, head_dim, dtype, seed=7)
    ctx = [prefix + new for prefix, new in SEGMENTS]
    lengths = torch.tensor([new for _, new in SEGMENTS])
    table = page_tables(ctx, seed=8)
    cu_seqlens = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).to(DEVICE)
    ctx_lens = torch.tensor(ctx, device=DEVICE)
    q = queries(int(lengths.sum()), heads, head_dim, dtype, seed=9)
    scale = head_dim ** -0.5
    got = backend.paged_prefill_attention(q, k_pool, v_pool, table, PAGE_SIZE, cu_seqlens, ctx_lens,
                                          int(lengths.max()), scale)
    assert_close(got, paged_prefill_reference(q, k_pool, v_pool, table, PAGE_SIZE, cu_seqlens, ctx_lens, scale))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", GQA_SHAPES)
def test_varlen_prefill_matches_the_reference(heads, kv_heads, head_dim):
    check_varlen_prefill(BACKEND, heads, kv_heads, head_dim)


@pytest.mark.parametrize("config", [
    ExtendConfig(block_n=128, longest_first=False),  # key blocks longer than a token block, grid in order
    ExtendConfig(block_n=32, rows=32),  # many short key blocks behind each token block
], ids=["block_n-128-in-order", "block_n-32-rows-32"])
def test_varlen_prefill_under_other_launch_constants(config):
    """The alternatives scripts/tune_gpu_kernels.py times compute the same attention, bf16 included."""
    backend = TritonAttention(extend=config)
    check_varlen_prefill(backend, 4, 2, 64)
    check_varlen_prefill(backend, 8, 1, 128, torch.bfloat16)


def test_a_mixed_step_writes_its_new_tokens_and_attends_every_row():
    """Decode rows and two prefill chunks (one after a cached prefix) in one batch: K/V written at the
    slots, then one decode call and one varlen call fill the rows in place."""
    heads, kv_heads, head_dim = 4, 2, 64
    k_pool, v_pool = pools(kv_heads, head_dim, torch.float32, seed=14)
    decode_ctx, prefill = [17, 1, 33], [(0, 5), (40, 12)]
    prefill_ctx = [prefix + new for prefix, new in prefill]
    table = page_tables(decode_ctx + prefill_ctx, seed=15)
    decode_table, prefill_table = table[:3], table[3:]

    def slots(table_row: torch.Tensor, positions: range) -> list[int]:
        return [int(table_row[p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in positions]

    slot_mapping = [s for row, ctx in zip(decode_table, decode_ctx) for s in slots(row, range(ctx - 1, ctx))]
    slot_mapping += [s for row, (prefix, new) in zip(prefill_table, prefill)
                     for s in slots(row, range(prefix, prefix + new))]
    tokens = len(slot_mapping)
    q = queries(tokens, heads, head_dim, torch.float32, seed=16)
    k_new, v_new = (queries(tokens, kv_heads, head_dim, torch.float32, seed=seed) for seed in (17, 18))
    lengths = [new for _, new in prefill]
    pages = PageTables(PAGE_SIZE, decode=decode_table, prefill=prefill_table,
                       prefill_cu_seqlens=torch.tensor([0, lengths[0], sum(lengths)], device=DEVICE),
                       prefill_ctx_lens=torch.tensor(prefill_ctx, device=DEVICE), max_prefill_len=max(lengths))
    segments = [PrefillSegment(3, lengths[0], prefill_ctx[0]),
                PrefillSegment(3 + lengths[0], lengths[1], prefill_ctx[1])]
    batch = ForwardBatch(input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
                         positions=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
                         slot_mapping=torch.tensor(slot_mapping, device=DEVICE), num_decode=3,
                         decode_ctx_lens=torch.tensor(decode_ctx, device=DEVICE), prefills=segments,
                         logits_indices=torch.arange(tokens, device=DEVICE), pages=pages)
    got = paged_attention(q, k_new, v_new, k_pool, v_pool, batch, 0.125, BACKEND)
    assert torch.equal(k_pool[batch.slot_mapping], k_new) and torch.equal(v_pool[batch.slot_mapping], v_new)
    assert_close(got[:3], paged_decode_reference(q[:3], k_pool, v_pool, decode_table, PAGE_SIZE,
                                                 batch.decode_ctx_lens, 0.125))
    assert_close(got[3:], paged_prefill_reference(q[3:], k_pool, v_pool, prefill_table, PAGE_SIZE,
                                                  pages.prefill_cu_seqlens, pages.prefill_ctx_lens, 0.125))


# ---- the model and the engine through the Triton backend, float32 against the torch path and transformers ----

PROMPT_LENGTHS = [1, 9, 40]
MAX_NEW = 4


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    model = load_hf(tiny_checkpoint)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=41)
    return prompts, [hf_greedy(model, prompt, MAX_NEW) for prompt in prompts]


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16, max_num_batched_tokens=4096),  # whole prompts in one step, then batched decodes
    dict(page_size=4, max_num_batched_tokens=24),  # chunked prefill mixed with decodes, on small pages
], ids=["batched", "chunked"])
def test_engine_on_triton_matches_transformers(tiny_checkpoint, oracle, engine_args):
    prompts, expected = oracle
    llm = LLM(str(tiny_checkpoint), dtype="float32", device=DEVICE.type, attention_backend="triton", num_pages=96,
              **engine_args)
    assert isinstance(llm.core.runner.forward.model.backend.attention, TritonAttention)
    assert_matches(llm.generate(prompts, greedy(MAX_NEW)), expected)
    second = llm.generate(prompts, greedy(MAX_NEW))  # the prompts' pages are cached now: prefix hits
    assert_matches(second, expected)
    assert sum(output.num_cached_tokens for output in second) > 0
    llm.core.check_integrity()


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """(the model on the Triton backend, the same weights on torch's SDPA)."""
    triton_model, config = load_model(tiny_checkpoint, torch.float32, DEVICE, attention_backend="triton")
    torch_model, _ = load_model(tiny_checkpoint, torch.float32, DEVICE, use_decode_kernel=False,
                                attention_backend="torch")
    assert isinstance(triton_model.backend.attention, TritonAttention) and torch_model.backend.attention is None
    return triton_model, torch_model, config


@torch.inference_mode()
def test_the_profiling_step_runs_either_form(models):
    """memory_profile's dummy step (several prefill chunks) gives the same hidden states through SDPA and
    through Triton."""
    triton_model, torch_model, config = models
    hidden = []
    for model in (triton_model, torch_model):
        batch = dummy_prefill_batch(70, 32, 8, DEVICE)
        cache = KVCache(model.cache_specs(), 3 * 4, 8, torch.float32, DEVICE)
        hidden.append(model(batch, ModelCaches(cache)))
    torch.testing.assert_close(hidden[0], hidden[1], rtol=0, atol=1e-4)


@torch.inference_mode()
def test_page_table_graph_buckets_pad_without_touching_real_slots(models):
    """DecodeGraphs with page tables (eager on the CPU): padded rows change no real row's output and
    write only the scratch page; one bucket per row count, whatever the context."""
    triton_model, _, config = models
    num_pages, page_size = 48, 4
    scratch_slot = num_pages * page_size

    def prefilled() -> tuple[PagedSequences, KVCache]:
        sequences = PagedSequences(num_pages, page_size, seed=3)
        cache = KVCache(triton_model.cache_specs(), num_pages + 1, page_size, torch.float32, DEVICE)
        for index, length in enumerate((9, 30, 17)):
            key = "abc"[index]
            sequences.add(key, random_tokens(length + 4, seed=index))
            batch, _ = sequences.batch(prefill=[(key, length)])
            triton_model(on_device(batch), ModelCaches(cache))
        return sequences, cache

    eager_sequences, eager_cache = prefilled()
    graph_sequences, graph_cache = prefilled()
    graphs = DecodeGraphs(triton_model, graph_cache, scratch_slot, page_table_width=16)
    for keys in (["a", "b", "c"], ["b", "c"], ["c"]):
        eager = on_device(eager_sequences.batch(decode=keys)[0])
        batch = on_device(graph_sequences.batch(decode=keys)[0])
        bucket = graphs.bucket(batch)
        assert bucket == {3: 4, 2: 2, 1: 1}[len(keys)]
        want = triton_model(eager, ModelCaches(eager_cache))
        torch.testing.assert_close(graphs.run(batch, bucket), want, rtol=0, atol=1e-5)
    real = slice(0, scratch_slot)
    torch.testing.assert_close(graph_cache.pools[:, :, real], eager_cache.pools[:, :, real], rtol=0, atol=1e-5)


def on_device(batch: ForwardBatch) -> ForwardBatch:
    """A PagedSequences batch (built on the CPU) on the backend's device."""
    return map_tensors(batch, lambda t: t.to(DEVICE))
