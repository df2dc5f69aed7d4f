"""The forward of a step in this process (`LocalForward`, a `StepForward`): loads the checkpoint, sizes and owns
the KV cache and the state pool, and runs a step's forward: from a CUDA graph where one fits, else eagerly (with
LoRA adapters' rows where any). A tensor-parallel rank runs one on its shard (engine/tp_worker.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from mili_openai.config import EngineConfig
from mili_openai.distributed import TensorParallelGroup
from mili_openai.engine.batch_builder import PromptScoring
from mili_openai.engine.cuda_graphs import DecodeGraphs
from mili_openai.engine.lora_manager import LoraManager
from mili_openai.engine.memory_budget import (
    BYTES_PER_GIB,
    DEFAULT_SNAPSHOT_FRACTION,
    check_kv_cache_fits,
    log_memory,
    pages_beside_states,
    snapshots_in_budget,
    weight_bytes,
)
from mili_openai.engine.memory_profile import profile_gpu_memory
from mili_openai.engine.speculation_setup import prepare_model_for_speculation, runner_speculation
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.engine.pooler import Pooler
from mili_openai.engine.pooling_spec import PoolingSpec
from mili_openai.engine.sampler import token_logprobs
from mili_openai.engine.step_forward import ForwardOutput, resolve_device
from mili_openai.engine.step_inputs import forward_batch_to
from mili_openai.engine.step_preparer import ForwardStep
from mili_openai.kernels import build_cpu_kernels_in_background, load_cpu_kernels
from mili_openai.model import KVCache, load_model, resolve_dtype
from mili_openai.model.backend_setup import use_cpu_kernels
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import ModelCaches, has_recurrent_layers
from mili_openai.model.state_cache import StateCache

logger = logging.getLogger(__name__)

PROMPT_SCORING_ROWS = 64  # prompt rows whose logits exist at once (64 x Qwen3's vocabulary: 39 MB)


class LocalForward:
    """The model and its caches in this process (a `StepForward`)."""

    failure: str | None = None  # this process's forward fails a step at a time, never for good
    # the CPU kernels compiling while the model runs on torch's ops (EngineConfig.cpu_kernels_in_background);
    # None when there is nothing to switch to
    kernel_build: Future[bool] | None = None
    pooler: Pooler | None = None  # a pooling model's (set_pooling); None: the model generates

    def __init__(self, config: EngineConfig, model_path: Path, parallel: TensorParallelGroup | None = None) -> None:
        """`parallel`: this process is one rank of a tensor-parallel group (engine/tp_worker.py) and holds its
        shard of the model and of the KV cache (its KV heads)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        config = config.for_device(self.device.type)
        self.model, self.model_config = load_model(model_path, resolve_dtype(config.dtype), self.device,
                                                   attention_backend=config.attention_backend, parallel=parallel,
                                                   quantization=config.quantization,
                                                   group_size=config.quantization_group_size,
                                                   lm_head_quantization=config.quantize_lm_head,
                                                   defer_cpu_kernels=config.cpu_kernels_in_background,
                                                   kernel_plan_cache=config.kernel_plan_cache)
        # LoRA slots wrap the projections before the memory is sized, so the KV budget counts them
        self.lora = LoraManager(config.lora, self.model) if config.lora is not None else None
        self.dtype = self.model.dtype
        self.quantization = self.model.quantization  # None, or what the weights are
        self.page_size = config.page_size
        self.async_launch = bool(config.async_launch)  # see Runner.async_launch
        self.rotary_table = self.model.rotary_table()
        self.parallel = parallel
        # MTP: its K/V layers join the specs; a draft model keeps pools of its own, sized with the target's
        self.draft = prepare_model_for_speculation(config, self.model, model_path, self.device,
                                                   defer_cpu_kernels=self.model.backend.awaits_cpu_kernels)
        # what each layer keeps per sequence, in this process's shapes (a tensor-parallel rank's KV heads)
        self.cache_specs = self.model.cache_specs()
        self.num_state_slots = config.max_num_seqs if has_recurrent_layers(self.cache_specs) else 0
        self.state_slot_bytes = slot_bytes = StateCache.bytes_per_slot(self.cache_specs, self.dtype)
        draft_slot_bytes = self.draft.slot_bytes() if self.draft is not None else 0
        # the prefix cache's state snapshots of a hybrid model: slots of the state pool past the running ones
        budget = None if config.num_pages else self._cache_budget(config)
        # a draft model with linear-attention layers snapshots its states beside the target's (engine/draft_model.py):
        # each slot, running or snapshot, holds both
        both_slot_bytes = slot_bytes + draft_slot_bytes
        self.num_state_snapshots = (self._snapshots(config, both_slot_bytes, budget)
                                    if self.num_state_slots and config.enable_prefix_caching else 0)
        # Dynamic NTK RoPE checks each forward's positions on the host, which a graph cannot capture; adapters
        # replay only through the Triton LoRA kernel (it reads a bucket's static row blocks)
        use_graphs = (self.device.type == "cuda" and not config.enforce_eager
                      and (self.lora is None or _replays_in_graphs(self.model.backend.lora))
                      and self.model.model.rotary_emb.dynamic_limit is None
                      and self.model.backend.attention is not None)
        # with graphs, one state slot past the running ones and the snapshots takes padded rows' states
        state_pool_slots = self.num_state_slots + self.num_state_snapshots + (1 if use_graphs else 0)
        state_bytes = state_pool_slots * both_slot_bytes if self.num_state_slots else 0
        self.num_pages = config.num_pages or self._pages_for_budget(budget, state_bytes)
        # with graphs, one page more than the engine hands out: its first slot takes padded rows' K/V
        pool_pages = self.num_pages + (1 if use_graphs else 0)
        weights = weight_bytes(self.model)
        kv_bytes = pool_pages * self._page_bytes()
        if self.draft is not None:
            weights += weight_bytes(self.draft.model)
        check_kv_cache_fits(kv_bytes + state_bytes, weights, self.device)
        self.kv_cache = KVCache(self.cache_specs, pool_pages, self.page_size, self.dtype, self.device)
        self.state_cache = (StateCache(self.cache_specs, state_pool_slots, self.dtype, self.device)
                            if self.num_state_slots else None)
        self.caches = ModelCaches(self.kv_cache, self.state_cache)
        draft_caches = (self.draft.caches(pool_pages, self.page_size, self.num_state_slots + self.num_state_snapshots,
                                          self.device)
                        if self.draft is not None else None)
        self.speculation = runner_speculation(config.speculative_config, self.model, self.caches, self.page_size,
                                              self.draft, draft_caches)
        log_memory(weights, self.quantization, self.dtype, kv_bytes, pool_pages, self.page_size, state_bytes,
                   self.num_state_slots, self.num_state_snapshots)
        self.decode_graphs = None
        if use_graphs:
            self._capture_decode_graphs(config)
        # for the sampler: None where the CPU cannot run the kernels, or until they are built
        on_kernels = self.device.type == "cpu" and not self.model.backend.awaits_cpu_kernels
        self.kernel_plan_cache = config.kernel_plan_cache
        self.cpu_kernels = load_cpu_kernels(self.kernel_plan_cache) if on_kernels else None
        if self.model.backend.awaits_cpu_kernels:  # torch's ops serve while the kernels build
            logger.info("serving on torch's ops until the CPU kernels are compiled")
            self.kernel_build = build_cpu_kernels_in_background()

    def switch_to_cpu_kernels(self) -> None:
        """Run on the compiled CPU kernels built in the background (`kernel_build` done): call on the forward
        thread, between steps, while no sequence runs, so that no request sees both paths' rounding. The plan
        (kernels/planning.py) is timed (or read from the plan cache) here, on the thread that runs the kernels."""
        build, self.kernel_build = self.kernel_build, None
        kernels = load_cpu_kernels(self.kernel_plan_cache) if build is not None and build.result() else None
        for model in (self.model, self.draft.model) if self.draft is not None else (self.model,):
            use_cpu_kernels(model, kernels)  # None (the build failed): torch's ops stay, awaiting nothing
        if kernels is None:
            return
        self.cpu_kernels = kernels
        logger.info("switched to the compiled CPU kernels")

    def _max_model_len(self, config: EngineConfig, num_pages: int) -> int:
        return min(config.max_model_len or self.model_config.max_position_embeddings, num_pages * self.page_size)

    def _cache_budget(self, config: EngineConfig) -> tuple[int, str]:
        """(bytes for the caches, what set them): kv_cache_memory_gb where given (always on CPU), else on CUDA
        what gpu_memory_utilization leaves after the weights and a profiled step (memory_profile.py)."""
        if config.kv_cache_memory_gb is not None:
            return int(config.kv_cache_memory_gb * BYTES_PER_GIB), f"kv_cache_memory_gb={config.kv_cache_memory_gb}"
        start = time.perf_counter()
        profile = profile_gpu_memory(self.model, self.page_size, config.max_num_batched_tokens,
                                     config.max_num_seqs, self._max_model_len(config, 1 << 62),
                                     config.gpu_memory_utilization, self.device)
        logger.info("%s (profiled in %.1f s)", profile.describe(), time.perf_counter() - start)
        return profile.kv_cache, (f"gpu_memory_utilization={config.gpu_memory_utilization} ({profile.describe()}; "
                                  "raise it, or lower max_num_batched_tokens)")

    def _snapshots(self, config: EngineConfig, slot_bytes: int, budget: tuple[int, str] | None) -> int:
        """How many prefix-cache state snapshots: `num_hybrid_snapshots`, else what `snapshots_in_budget` gives of
        the cache budget (with `num_pages`: of a whole whose default share they would be, those pages and the
        running slots being the rest)."""
        fraction, count = config.hybrid_snapshot_fraction, config.num_hybrid_snapshots
        if budget is not None:
            total = budget[0]
        else:
            beside = config.num_pages * self._page_bytes()
            share = fraction if fraction is not None else DEFAULT_SNAPSHOT_FRACTION
            total = int((beside + self.num_state_slots * slot_bytes) / (1 - share))
        count = snapshots_in_budget(total, slot_bytes, fraction, count, self.num_state_slots)
        # tensor-parallel ranks number their snapshots alike: the fewest any of them has room for
        return count if self.parallel is None else self.parallel.min_over_ranks(count)

    def _pages_for_budget(self, budget: tuple[int, str], state_bytes: int) -> int:
        """Pages of the KV pool: what the cache budget holds beside a state pool of `state_bytes`
        (memory_budget.py). Tensor-parallel ranks take the fewest any of them has room for: they share one page
        table."""
        num_pages = pages_beside_states(budget[0], self._page_bytes(), state_bytes, budget[1])
        return num_pages if self.parallel is None else self.parallel.min_over_ranks(num_pages)

    def _page_bytes(self) -> int:
        """Bytes one page takes in every pool over the pages: the target's attention layers', and a draft model's."""
        draft = self.draft.page_bytes(self.page_size) if self.draft is not None else 0
        return KVCache.bytes_per_page(self.cache_specs, self.page_size, self.dtype) + draft

    def _capture_decode_graphs(self, config: EngineConfig) -> None:
        """Decode steps' CUDA graphs for up to max_num_seqs rows, captured before serving (cuda_graphs.py)."""
        scratch_slot = self.num_pages * self.page_size  # the first slot of the page past those handed out
        # every context the engine admits fits the graphs' page tables
        width = -(-self._max_model_len(config, self.num_pages) // self.page_size)
        # a hybrid's padded rows: the state pool's last slot, past the running ones and the snapshots
        scratch_state_slot = self.state_cache.num_slots - 1 if self.state_cache is not None else None
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, scratch_slot, width, self.state_cache,
                                          scratch_state_slot, self.lora.slots if self.lora is not None else None)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                count = self.decode_graphs.capture_ahead(config.max_num_seqs)
        except RuntimeError:  # an op the capture refuses (a host copy, a sync): serve eagerly, slower but right
            logger.exception("capturing the decode steps' CUDA graphs failed: decode steps run eagerly")
            self.decode_graphs = None
            return
        logger.info("captured %d CUDA graphs of decode steps (up to %d rows) in %.1f s", count, config.max_num_seqs,
                    time.perf_counter() - start)

    def inputs(self, work: ForwardStep) -> ForwardBatch:
        return forward_batch_to(work.batch, self.device, work.staged)

    @torch.inference_mode()
    def run(self, work: ForwardStep, batch: ForwardBatch) -> ForwardOutput:
        """Queue the forward (on CPU: run it). Every op is asynchronous on CUDA but prompt scoring's, which reads
        its logprobs at once (a prefill chunk's, rare)."""
        if work.new_state_slots is not None:  # sequences admitted in this step start from zero states
            self.state_cache.reset(work.new_state_slots)
        if work.state_restores is not None:  # or from a prefix's state snapshot (engine/state_snapshots.py)
            self.state_cache.copy(*work.state_restores)
        if self.speculation is not None:  # verify rows keep their states; a proposer's slots start as the target's
            self.speculation.before_forward(batch, work.new_state_slots, work.state_restores)
        bucket = self.decode_graphs.bucket(batch) if self.decode_graphs is not None else None
        if bucket is not None:
            groups = self.lora.groups(work.lora_ids, self.device) if work.lora_ids is not None else None
            hidden = self.decode_graphs.run(batch, bucket, groups)  # (T, hidden)
        elif work.lora_ids is not None:  # rows on adapters: each LoRA projection adds its rows' deltas
            with self.lora.slots.rows(self.lora.groups(work.lora_ids, self.device)):
                hidden = self.model(batch, self.caches)
        else:
            hidden = self.model(batch, self.caches)
        if work.state_saves is not None:  # states at page boundaries into the prefix cache's snapshots
            self.state_cache.copy(*work.state_saves)
        scored = self.score_prompts(hidden, work.prompt_scorings) if work.prompt_scorings else None
        # (S, vocab) float32
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if work.num_sampled else None
        pooled = self.pooler(hidden, work.pooling_rows) if work.pooling_rows and self.pooler is not None else None
        return ForwardOutput(hidden, logits, scored, pooled)

    def set_pooling(self, spec: PoolingSpec) -> None:
        self.pooler = Pooler.for_model(spec, self.model)

    def close(self) -> None:
        """Nothing outside this process to let go."""

    def expert_load(self) -> dict[int, list[int]]:
        """{sparse layer: (token, expert) pairs each expert received since load}; empty for a dense model."""
        return self.model.expert_load()

    def score_prompts(self, hidden: torch.Tensor, scorings: list[PromptScoring]
                      ) -> dict[int, tuple[int, list[TokenLogprob]]]:
        """Each scored prompt token's logprob from its row's logits, a block of rows at a time: a whole
        chunk's logits at once would be chunk x vocabulary floats (300 MB for 512 Qwen3 tokens)."""
        scored = {}
        for scoring in scorings:
            entries: list[TokenLogprob] = []
            for offset in range(0, len(scoring.targets), PROMPT_SCORING_ROWS):
                targets = scoring.targets[offset : offset + PROMPT_SCORING_ROWS]
                start = scoring.row + offset
                logits = self.model.compute_logits(hidden[start : start + len(targets)])  # (R, vocab) float32
                entries.extend(token_logprobs(logits, targets, [scoring.top_k] * len(targets), with_ranks=True))
            scored[scoring.batch_index] = (scoring.first, entries)
        return scored


def _replays_in_graphs(lora_fn) -> bool:
    """Whether the adapters' op takes a graph bucket's static row blocks: the Triton kernel's (kernels/triton_lora.py;
    imported here, on CUDA only, as it imports Triton)."""
    from mili_openai.kernels.triton_lora import triton_add_lora

    return triton_add_lora is not None and lora_fn is triton_add_lora
