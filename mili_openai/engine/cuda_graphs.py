"""Decode steps replayed from CUDA graphs, as vLLM and SGLang run them.

Why: in eager mode every op of the forward is a Python call that launches a kernel, ~50 per layer, and
for a small model the launches, not the GPU, bound a decode step. A graph captured once launches the
whole stack in one call. Figures and commands: docs/performance.md, "CUDA".

A graph fixes its tensors' shapes and addresses, so each one serves a bucket of up to `rows` decode rows.
The attention kernel reads contexts in place through page tables (model/paged_attention.py), so a graph's
shape does not depend on context length: its page table is as wide as the longest context the engine
admits, and the kernel's split count depends on the rows (and the GPU) alone. The buckets are vLLM's
capture sizes (1, 2, 4, then every multiple of 8 up to 256), all captured before serving (a capture
costs far more than a step, and no request should wait on one); all share one memory pool, since a step
runs one graph at a time. A step is copied into its bucket's static inputs, padded: rows past the step's
write their K/V to a scratch page past the pages the engine hands out, attend to its first slot, and
their outputs are dropped; each row's pages past its context length are masked by its length. A hybrid
model's rows also carry their state slots (Gated DeltaNet's conv window and recurrent state, updated in place):
padded rows take a scratch state slot past those the engine hands out. Served LoRA adapters are captured in every
graph: each bucket holds static row blocks (kernels/lora.py's `BucketLoraRows`) that a step's adapter groups are
copied into, padded rows in none. Steps with prefill chunks run eagerly, and so do a hybrid's steps that verify
drafts (their rows run depth by depth over one slot) and a model whose attention has no kernel (torch's SDPA
would gather every row's whole page table).

Built on the CPU too, where it replays nothing and runs the padded batch eagerly: the padding is then
testable without a GPU (tests/engine/test_cuda_graphs.py), and the GPU adds only capture and replay.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mili_openai.kernels.lora import SGMV_BLOCK_ROWS, BucketLoraRows, LoraGroup
from mili_openai.model import KVCache
from mili_openai.model.batch import ForwardBatch, PageTables
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.lora_layers import LoraSlots
from mili_openai.model.state_cache import StateCache

CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))  # vLLM's: a step pads at most 7 rows


def capture_size(rows: int) -> int | None:
    return next((size for size in CAPTURE_SIZES if size >= rows), None)


@dataclass(slots=True)
class DecodeGraph:
    inputs: ForwardBatch  # static: copied into before each run
    hidden: torch.Tensor | None  # static output (rows, hidden) of the captured forward; None on CPU
    graph: torch.cuda.CUDAGraph | None  # None on CPU: the padded batch runs eagerly
    lora_rows: BucketLoraRows | None  # the adapters' static row blocks, where adapters are served


class DecodeGraphs:
    """Runs decode-only forward batches through per-bucket CUDA graphs (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, scratch_slot: int, page_table_width: int,
                 state_cache: StateCache | None = None, scratch_state_slot: int | None = None,
                 lora: LoraSlots | None = None) -> None:
        """page_table_width: the pages of the longest context (the graphs' page tables are this wide);
        state_cache: a hybrid model's state pool, whose slot `scratch_state_slot` padded rows take; lora: the
        adapter slots served (their ops must take a bucket's static blocks: the Triton kernel)."""
        if not 0 <= scratch_slot < kv_cache.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the KV cache's {kv_cache.num_slots} slots")
        if page_table_width < 1 or scratch_slot % kv_cache.page_size:
            raise ValueError("decode graphs need a page table width >= 1 and a scratch slot at the start of a page")
        if state_cache is not None and (scratch_state_slot is None
                                        or not 0 <= scratch_state_slot < state_cache.num_slots):
            raise ValueError(f"scratch state slot {scratch_state_slot} is outside the state pool's "
                             f"{state_cache.num_slots} slots")
        self.model = model
        self.kv_cache = kv_cache
        self.caches = ModelCaches(kv_cache, state_cache)  # what the model's forward reads
        self.scratch_slot = scratch_slot
        self.scratch_state_slot = scratch_state_slot if state_cache is not None else None
        self.lora = lora
        self.page_table_width = page_table_width
        self.device = kv_cache.device
        self.graphs: dict[int, DecodeGraph] = {}  # by rows
        self.steps_run = 0  # decode steps run through a bucket
        self._pool = None  # the captured graphs' shared memory pool, from the first capture

    def capture_ahead(self, max_rows: int) -> int:
        """Capture every bucket up to `max_rows` rows not captured yet, the largest first (as vLLM does: the
        pool takes the largest graph's memory, and the smaller ones reuse it) -> how many were captured."""
        size_limit = capture_size(max_rows) or CAPTURE_SIZES[-1]
        sizes = [rows for rows in CAPTURE_SIZES if rows <= size_limit and rows not in self.graphs]
        for rows in reversed(sizes):
            self.graphs[rows] = self._capture(rows)
        return len(sizes)

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The rows of the bucket whose graph runs the batch, or None where it must run eagerly: only decode
        rows (one token each, drafts included), with positions' rotary computed in the forward, within the
        largest bucket and the graphs' page table width; none of an image sequence's (their mRoPE positions are
        not the text positions a graph reads), nor a hybrid's verifying drafts (run depth by depth)."""
        if batch.prefills or batch.decode_ctx_lens is None or batch.rotary is not None or batch.vision is not None:
            return None
        if batch.state_slots is not None and (self.scratch_state_slot is None or batch.decode_groups is not None):
            return None
        rows = capture_size(batch.num_tokens)
        if rows is None or batch.pages.decode.shape[1] > self.page_table_width:
            return None
        return rows

    def run(self, batch: ForwardBatch, bucket: int, lora_groups: list[LoraGroup] | None = None) -> torch.Tensor:
        """-> (rows, hidden) after the final norm, as `model(batch, kv_cache)`; a view of the graph's output,
        valid until the next run. `bucket` is the batch's (from `bucket`); the batch lives on the cache's
        device; `lora_groups`: its rows by adapter slot, where adapters are served (none: every row on the base)."""
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket)
        self._fill(entry.inputs, batch)
        if entry.lora_rows is not None:
            entry.lora_rows.fill(lora_groups or [], batch.num_tokens, self.device)
        self.steps_run += 1
        if entry.graph is None:
            with self._adapters(entry):
                return self.model(entry.inputs, self.caches)[:batch.num_tokens]
        entry.graph.replay()
        return entry.hidden[:batch.num_tokens]

    def _adapters(self, entry: DecodeGraph):
        """Where adapters are served, the bucket's rows by slot for the LoRA projections of the forward."""
        return self.lora.rows(entry.lora_rows) if entry.lora_rows is not None else nullcontext()

    def _fill(self, inputs: ForwardBatch, batch: ForwardBatch) -> None:
        """The step's rows into the static inputs; the rows past them write and read the scratch slot.

        Page table entries past a row's pages are left as an earlier step wrote them: masked by its length."""
        rows = batch.num_tokens
        fields = [(inputs.input_ids, batch.input_ids, 0), (inputs.positions, batch.positions, 0),
                  (inputs.slot_mapping, batch.slot_mapping, self.scratch_slot),
                  (inputs.decode_ctx_lens, batch.decode_ctx_lens, 1)]
        if inputs.state_slots is not None:  # padded rows run the scratch state slot's state (and spoil it)
            fields.append((inputs.state_slots, batch.state_slots, self.scratch_state_slot))
        for static, values, padding in fields:
            static[:rows].copy_(values)
            static[rows:].fill_(padding)
        # a padded row reads its table's first page: the scratch page, or any page a real row left there
        # (finite, and its output is dropped)
        table = batch.pages.decode
        inputs.pages.decode[:rows, : table.shape[1]].copy_(table)

    def _static_inputs(self, rows: int) -> ForwardBatch:
        def filled(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=self.device)

        page_size = self.kv_cache.page_size
        pages = PageTables(page_size, decode=filled((rows, self.page_table_width), self.scratch_slot // page_size),
                           prefill=None, prefill_cu_seqlens=None, prefill_ctx_lens=None)
        state_slots = filled((rows,), self.scratch_state_slot) if self.scratch_state_slot is not None else None
        return ForwardBatch(
            input_ids=filled((rows,), 0), positions=filled((rows,), 0),
            slot_mapping=filled((rows,), self.scratch_slot), num_decode=rows, decode_ctx_lens=filled((rows,), 1),
            prefills=[], logits_indices=torch.arange(rows, device=self.device), pages=pages, state_slots=state_slots)

    def _capture(self, rows: int) -> DecodeGraph:
        inputs = self._static_inputs(rows)
        lora_rows = (BucketLoraRows(rows, self.lora.num_slots, SGMV_BLOCK_ROWS, self.device) if self.lora is not None
                     else None)
        entry = DecodeGraph(inputs, None, None, lora_rows)
        if self.device.type != "cuda":
            return entry
        # A warm-up run first, on a side stream as torch's docs ask: it makes cuBLAS's handles and workspaces,
        # which capture cannot. Padded rows only write the scratch slots, so it touches no sequence's K/V or state.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._adapters(entry):
            self.model(inputs, self.caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the event loop thread may touch CUDA meanwhile (a seeded request's generator), which
        # the default "global" mode would count as an error in this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), self._adapters(entry):
            hidden = self.model(inputs, self.caches)
        if self._pool is None:
            self._pool = graph.pool()
        return DecodeGraph(inputs, hidden, graph, lora_rows)
