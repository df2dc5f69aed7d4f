"""Decode steps replayed from CUDA graphs, as vLLM and SGLang run them.

Why: in eager mode every op of the forward is a Python call that launches a kernel, ~50 per layer, and
for a small model the launches, not the GPU, bound a decode step. A graph captured once launches the
whole stack in one call. Figures and commands: docs/performance.md, "CUDA".

A graph fixes its tensors' shapes and addresses, so each one serves a bucket: up to `rows` decode rows
whose contexts fit `context` slots. A step is copied into the bucket's static inputs, padded:
- rows past the step's write their K/V to a scratch slot past the pages the engine hands out, attend to
  one slot, and their outputs are dropped;
- each row's context past its length is masked by its length.
The runner captures the buckets of up to `max_num_seqs` rows and `AHEAD_CONTEXT` slots before serving (a
capture costs far more than a step, and no request should wait on one); others are captured the first
time they are needed. All share one memory pool: a step runs one graph at a time. Steps with prefill
chunks, and buckets past `MAX_GATHERED_SLOTS`, run eagerly.

With a page-table attention kernel (Triton; `page_table_width` given) a graph's shape no longer depends on
context length: the page table is as wide as the longest context the engine admits, and the kernel's
split count on the rows (and the GPU) alone. Then a bucket is a row count only, vLLM's capture sizes (1, 2, 4,
then every multiple of 8 up to 256), all captured at start-up; padded rows read the scratch page.

Built on the CPU too, where it replays nothing and runs the padded batch eagerly: the padding is then
testable without a GPU (tests/test_cuda_graphs.py), and the GPU adds only capture and replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mili_openai.model import KVCache
from mili_openai.model.batch import ForwardBatch, PageTables
from mili_openai.model.cache_spec import ModelCaches

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # with gathered contexts, times each context bucket
CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))  # with page tables: vLLM's, a step pads at most 7 rows
PAGED_CONTEXT = 0  # the context part of a page-table bucket's key: one graph serves every context
MIN_CONTEXT_BUCKET = 256  # contexts are padded to a power of two from here: few graphs, at most 2x the gather
# The torch decode path gathers every row's context (K and V, per layer) into a (rows, context) copy; a
# graph keeps that buffer for good. 2^18 slot-rows is 1 GiB for K and V in Qwen3-0.6B shapes, bf16.
MAX_GATHERED_SLOTS = 1 << 18
AHEAD_CONTEXT = 2048  # contexts of the buckets captured before serving: chat turns and short documents


def row_bucket(rows: int) -> int | None:
    return next((bucket for bucket in ROW_BUCKETS if bucket >= rows), None)


def context_bucket(context: int) -> int:
    return max(MIN_CONTEXT_BUCKET, 1 << (context - 1).bit_length())


def capture_size(rows: int) -> int | None:
    return next((size for size in CAPTURE_SIZES if size >= rows), None)


@dataclass(slots=True)
class DecodeGraph:
    inputs: ForwardBatch  # static: copied into before each run
    hidden: torch.Tensor | None  # static output (rows, hidden) of the captured forward; None on CPU
    graph: torch.cuda.CUDAGraph | None  # None on CPU: the padded batch runs eagerly


class DecodeGraphs:
    """Runs decode-only forward batches through per-bucket CUDA graphs (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, scratch_slot: int,
                 page_table_width: int | None = None) -> None:
        """page_table_width: for a model that reads page tables, the pages of the longest context (its
        graphs' page tables are this wide); None for one that reads gathered slot tables."""
        if not 0 <= scratch_slot < kv_cache.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the KV cache's {kv_cache.num_slots} slots")
        if page_table_width is not None and (page_table_width < 1 or scratch_slot % kv_cache.page_size):
            raise ValueError("page-table graphs need a width >= 1 and a scratch slot at the start of a page")
        self.model = model
        self.kv_cache = kv_cache
        self.caches = ModelCaches(kv_cache)  # what the model's forward reads (attention layers only, yet)
        self.scratch_slot = scratch_slot
        self.page_table_width = page_table_width
        self.device = kv_cache.device
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.steps_run = 0  # decode steps run through a bucket
        self._pool = None  # the captured graphs' shared memory pool, from the first capture

    def capture_ahead(self, max_rows: int, max_context: int) -> int:
        """Capture every bucket up to `max_rows` rows and `max_context` slots not captured yet, the largest
        first (as vLLM does: the pool takes the largest graph's memory, and the smaller ones reuse it).
        -> how many were captured. With page tables, every row count up to `max_rows` (contexts do not matter)."""
        if self.page_table_width is not None:
            size_limit = capture_size(max_rows) or CAPTURE_SIZES[-1]
            keys = [(rows, PAGED_CONTEXT) for rows in CAPTURE_SIZES
                    if rows <= size_limit and (rows, PAGED_CONTEXT) not in self.graphs]
            for key in reversed(keys):
                self.graphs[key] = self._capture(*key)
            return len(keys)
        row_limit = row_bucket(max_rows) or ROW_BUCKETS[-1]
        contexts = [MIN_CONTEXT_BUCKET]
        while contexts[-1] < context_bucket(max_context):
            contexts.append(contexts[-1] * 2)
        keys = [(rows, context) for rows in ROW_BUCKETS if rows <= row_limit for context in contexts
                if rows * context <= MAX_GATHERED_SLOTS and (rows, context) not in self.graphs]
        for rows, context in sorted(keys, key=lambda key: key[0] * key[1], reverse=True):
            self.graphs[rows, context] = self._capture(rows, context)
        return len(keys)

    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The (rows, context) bucket whose graph runs the batch, or None where it must run eagerly: only
        decode rows (one token each, drafts included), with positions' rotary computed in the forward,
        within the largest bucket."""
        if batch.prefills or batch.decode_ctx_lens is None or batch.rotary is not None:
            return None
        if self.page_table_width is not None:
            rows = capture_size(batch.num_tokens)
            if batch.pages is None or rows is None or batch.pages.decode.shape[1] > self.page_table_width:
                return None
            return rows, PAGED_CONTEXT
        if batch.decode_slots is None:
            return None
        rows, context = row_bucket(batch.num_tokens), context_bucket(int(batch.decode_slots.shape[1]))
        if rows is None or rows * context > MAX_GATHERED_SLOTS:
            return None
        return rows, context

    def run(self, batch: ForwardBatch, bucket: tuple[int, int]) -> torch.Tensor:
        """-> (rows, hidden) after the final norm, as `model(batch, kv_cache)`; a view of the graph's output,
        valid until the next run. `bucket` is the batch's (from `bucket`); the batch lives on the cache's
        device."""
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(*bucket)
        self._fill(entry.inputs, batch)
        self.steps_run += 1
        if entry.graph is None:
            return self.model(entry.inputs, self.caches)[:batch.num_tokens]
        entry.graph.replay()
        return entry.hidden[:batch.num_tokens]

    def _fill(self, inputs: ForwardBatch, batch: ForwardBatch) -> None:
        """The step's rows into the static inputs; the rows past them write and read the scratch slot.

        Context slots past a row's length are left as an earlier step wrote them: they are masked, and any
        slot's K/V is finite (the pool starts zeroed), so their zero weights keep them out of the output."""
        rows = batch.num_tokens
        for static, values, padding in ((inputs.input_ids, batch.input_ids, 0),
                                        (inputs.positions, batch.positions, 0),
                                        (inputs.slot_mapping, batch.slot_mapping, self.scratch_slot),
                                        (inputs.decode_ctx_lens, batch.decode_ctx_lens, 1)):
            static[:rows].copy_(values)
            static[rows:].fill_(padding)
        if inputs.pages is not None:  # a padded row reads its table's first page: the scratch page, or any
            table = batch.pages.decode  # page a real row left there (finite, and its output is dropped)
            inputs.pages.decode[:rows, : table.shape[1]].copy_(table)
        else:
            inputs.decode_slots[:rows, : batch.decode_slots.shape[1]].copy_(batch.decode_slots)

    def _static_inputs(self, rows: int, context: int) -> ForwardBatch:
        def filled(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=self.device)

        pages = decode_slots = None
        if self.page_table_width is not None:
            page_size = self.kv_cache.page_size
            pages = PageTables(page_size, decode=filled((rows, self.page_table_width), self.scratch_slot // page_size),
                               prefill=None, prefill_cu_seqlens=None, prefill_ctx_lens=None)
        else:
            decode_slots = filled((rows, context), self.scratch_slot)
        return ForwardBatch(
            input_ids=filled((rows,), 0), positions=filled((rows,), 0),
            slot_mapping=filled((rows,), self.scratch_slot), num_decode=rows,
            decode_slots=decode_slots, decode_ctx_lens=filled((rows,), 1),
            prefills=[], logits_indices=torch.arange(rows, device=self.device), pages=pages)

    def _capture(self, rows: int, context: int) -> DecodeGraph:
        inputs = self._static_inputs(rows, context)
        if self.device.type != "cuda":
            return DecodeGraph(inputs, None, None)
        # A warm-up run first, on a side stream as torch's docs ask: it makes cuBLAS's handles and workspaces,
        # which capture cannot. Padded rows only write the scratch slot, so it touches no sequence's K/V.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model(inputs, self.caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the event loop thread may touch CUDA meanwhile (a seeded request's generator), which
        # the default "global" mode would count as an error in this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self.model(inputs, self.caches)
        if self._pool is None:
            self._pool = graph.pool()
        return DecodeGraph(inputs, hidden, graph)
