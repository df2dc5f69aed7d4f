"""How much GPU memory the KV cache may take, as vLLM's `--gpu-memory-utilization` decides it.

The engine may fill `utilization` of the GPU's memory. What it already holds (the weights, the CUDA
context and library workspaces, anything another process took) is read from the driver after one dummy
forward of the largest step the scheduler can build (`max_num_batched_tokens` prefill tokens, then the
logits and sampling of `max_num_seqs` rows); that forward's peak of transient memory is kept free too.
The caches get the rest (memory_budget.py splits it between the state pool and the KV pool). The dummy forward also compiles the prefill kernels before any request waits
on them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mili_openai.model import ForwardBatch, KVCache, PrefillSegment, Qwen3ForCausalLM
from mili_openai.model.batch import PageTables
from mili_openai.model.cache_spec import ModelCaches, has_recurrent_layers
from mili_openai.model.state_cache import StateCache

logger = logging.getLogger(__name__)

BYTES_PER_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuMemoryProfile:
    total: int  # bytes of GPU memory
    in_use: int  # held after the profile: weights, CUDA context, workspaces, other processes
    peak_activation: int  # transient bytes of the largest step, beyond the KV cache it wrote to
    kv_cache: int  # what the caches may take (KV and state pools): total * utilization - in_use - peak_activation

    def describe(self) -> str:
        gib = {name: getattr(self, name) / BYTES_PER_GIB for name in ("total", "in_use", "peak_activation", "kv_cache")}
        return ("GPU memory {total:.2f} GiB: {in_use:.2f} GiB in use (weights, CUDA context, other processes), "
                "{peak_activation:.2f} GiB peak activation, {kv_cache:.2f} GiB for the KV cache").format(**gib)


def dummy_prefill_batch(num_tokens: int, segment_len: int, page_size: int, device: torch.device) -> ForwardBatch:
    """num_tokens prompt tokens as prefill chunks of up to segment_len from position 0, on consecutive pages
    from page 0, every chunk's last row sampled."""
    lengths = [min(segment_len, num_tokens - start) for start in range(0, num_tokens, segment_len)]
    pages_per_segment = -(-segment_len // page_size)
    positions = torch.cat([torch.arange(length) for length in lengths])
    first_page = torch.arange(len(lengths)) * pages_per_segment
    segment_of_row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slots = first_page[segment_of_row] * page_size + positions
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    prefills = [PrefillSegment(start, length, length) for start, length in zip(starts, lengths)]
    table = first_page[:, None] + torch.arange(pages_per_segment)[None, :]
    pages = PageTables(page_size, decode=None, prefill=table.to(device),
                       prefill_cu_seqlens=torch.tensor(starts, device=device),
                       prefill_ctx_lens=torch.tensor(lengths, device=device), max_prefill_len=max(lengths))
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device), positions=positions.to(device),
        slot_mapping=slots.to(device), num_decode=0, decode_ctx_lens=None, prefills=prefills,
        logits_indices=torch.tensor(starts[1:], device=device) - 1, pages=pages)


@torch.inference_mode()
def profile_gpu_memory(model: Qwen3ForCausalLM, page_size: int, max_num_batched_tokens: int,
                       max_num_seqs: int, max_model_len: int, utilization: float,
                       device: torch.device) -> GpuMemoryProfile:
    """Run the largest step once and size the KV cache from what is left (see the module docstring)."""
    dtype = model.dtype  # the activations' (quantized weights have other dtypes)
    segment_len = min(max_num_batched_tokens, max_model_len)
    batch = dummy_prefill_batch(max_num_batched_tokens, segment_len, page_size, device)
    num_pages = len(batch.prefills) * -(-segment_len // page_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    specs = model.cache_specs()
    cache = KVCache(specs, num_pages, page_size, dtype, device)
    states = None
    if has_recurrent_layers(specs):  # a state slot per chunk, as the engine gives each sequence one
        states = StateCache(specs, len(batch.prefills), dtype, device)
        batch.state_slots = torch.arange(len(batch.prefills), device=device)
    hidden = model(batch, ModelCaches(cache, states))
    rows = torch.arange(max_num_batched_tokens, device=device)[-min(max_num_seqs, max_num_batched_tokens):]
    probs = model.compute_logits(hidden[rows]).softmax(dim=-1)  # (rows, vocab) float32, as the sampler's
    probs.div_(torch.rand_like(probs)).argmax(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache.nbytes - (states.nbytes if states else 0)
    del cache, states, hidden, probs
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    kv_cache = int(total * utilization) - in_use - peak
    return GpuMemoryProfile(total=total, in_use=in_use, peak_activation=peak, kv_cache=kv_cache)
