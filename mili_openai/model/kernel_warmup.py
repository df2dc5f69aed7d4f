"""Compile the CUDA path's Triton kernels while the model loads, before any request can wait on one.

Triton compiles a kernel the first time it meets a new combination of its constexprs (block sizes, split
counts, dtypes) and argument specialisations. The kernels leave every launch-varying argument unspecialised
(page tables, index tensors, row counts: see kernels/triton_attention_kernels.py), so a server meets a
small, fixed set of variants, chosen by the model's shapes and a step's row counts. A few forwards over a
scratch KV cache, one per row-count class, compile all of them, as vLLM warms up before it reports ready:

- a mixed step: decode rows, a prefill chunk after a cached prefix page and a longer fresh prompt, with
  enough tokens that the MoE and quantized matmuls pick their prefill block sizes;
- a decode step of the fewest rows that gets each split count of the decode kernel (`decode_rows`): the
  CUDA graphs would compile only those of the batch sizes they capture, and an eager server none;
- the logits of each, so that a quantized LM head meets the row counts it picks its tiles by.

A hybrid model's steps also carry state slots (its Gated DeltaNet kernels take them unspecialised): its warm-up
runs over a scratch state pool of a slot per decode row and prefill chunk.

Any page size gives the same variants (the kernels take it unspecialised), so this needs no engine setting.
"""

from __future__ import annotations

import torch

from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment
from mili_openai.model.config import ModelConfig
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.kv_cache import KVCache
from mili_openai.model.qwen3 import Qwen3ForCausalLM
from mili_openai.model.qwen3_5 import Qwen3_5ForCausalLM
from mili_openai.model.state_cache import StateCache

WARMUP_PAGE_SIZE = 16
MIXED_DECODE_ROWS = 4
# (cached prefix, new tokens) of the mixed step's prefill chunks: a radix hit, and a prompt long enough that
# grouped kernels choose their large blocks (Qwen3-MoE's 128 experts x top-8 switch at 256 tokens)
MIXED_SEGMENTS = ((WARMUP_PAGE_SIZE, WARMUP_PAGE_SIZE), (0, 480))
MAX_LOGITS_ROWS = 256  # the rows a step samples at most by default (max_num_seqs)


def _pages(length: int) -> int:
    return -(-length // WARMUP_PAGE_SIZE)


def mixed_step(device: torch.device) -> tuple[ForwardBatch, int]:
    """(the mixed step's batch, the pages it uses). Decode rows attend to one slot of page 0 (and all write
    it); each prefill chunk owns the pages of its whole context, after page 0."""
    tokens = MIXED_DECODE_ROWS + sum(new for _, new in MIXED_SEGMENTS)
    positions = [0] * MIXED_DECODE_ROWS
    slots = [0] * MIXED_DECODE_ROWS
    table_rows, prefills, first_page = [], [], 1
    row = MIXED_DECODE_ROWS
    for prefix, new in MIXED_SEGMENTS:
        pages = list(range(first_page, first_page + _pages(prefix + new)))
        first_page += len(pages)
        table_rows.append(pages)
        positions += range(prefix, prefix + new)
        slots += [pages[p // WARMUP_PAGE_SIZE] * WARMUP_PAGE_SIZE + p % WARMUP_PAGE_SIZE
                  for p in range(prefix, prefix + new)]
        prefills.append(PrefillSegment(row, new, prefix + new))
        row += new
    width = max(len(pages) for pages in table_rows)
    table = torch.tensor([pages + [0] * (width - len(pages)) for pages in table_rows], device=device)
    lengths = [new for _, new in MIXED_SEGMENTS]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    pages = PageTables(WARMUP_PAGE_SIZE, decode=torch.zeros(MIXED_DECODE_ROWS, 1, dtype=torch.int64, device=device),
                       prefill=table, prefill_cu_seqlens=cu_seqlens,
                       prefill_ctx_lens=torch.tensor([prefix + new for prefix, new in MIXED_SEGMENTS], device=device),
                       max_prefill_len=max(lengths))
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
        num_decode=MIXED_DECODE_ROWS,
        decode_ctx_lens=torch.ones(MIXED_DECODE_ROWS, dtype=torch.int64, device=device), prefills=prefills,
        logits_indices=torch.arange(tokens, device=device), pages=pages)
    return batch, first_page


def decode_step(rows: int, device: torch.device) -> ForwardBatch:
    """`rows` decode rows at position 0, each attending to (and writing) slot 0."""
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    pages = PageTables(WARMUP_PAGE_SIZE, decode=zeros[:, None], prefill=None, prefill_cu_seqlens=None,
                       prefill_ctx_lens=None)
    return ForwardBatch(input_ids=zeros, positions=zeros, slot_mapping=zeros, num_decode=rows,
                        decode_ctx_lens=zeros + 1, prefills=[], logits_indices=torch.arange(rows, device=device),
                        pages=pages)


@torch.inference_mode()
def warm_up_kernels(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, config: ModelConfig, decode_rows: list[int],
                    device: torch.device) -> int:
    """Run the forwards that compile every kernel variant (module docstring) on a scratch KV cache (and, for a
    hybrid, state pool) of `config`'s shapes (this rank's, under tensor parallelism), freed after -> how many
    forwards ran. decode_rows: the row counts of the decode steps (each the fewest rows of one decode split
    count)."""
    mixed, pages = mixed_step(device)
    specs = model.cache_specs()
    slots = MIXED_DECODE_ROWS + len(MIXED_SEGMENTS)  # one per decode row and prefill chunk of the mixed step
    states = StateCache(specs, slots, model.dtype, device) if config.hybrid is not None else None
    cache = ModelCaches(KVCache(specs, pages, WARMUP_PAGE_SIZE, model.dtype, device), states)
    if states is not None:
        mixed.state_slots = torch.arange(slots, device=device)
    model.compute_logits(model(mixed, cache)[:MAX_LOGITS_ROWS])
    for rows in decode_rows:
        batch = decode_step(rows, device)
        if states is not None:  # every row on slot 0, as every row attends to slot 0 of page 0
            batch.state_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        model.compute_logits(model(batch, cache))
    del cache
    return 1 + len(decode_rows)
