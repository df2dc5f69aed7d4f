"""What the engine hands back: per-step deltas for streaming, whole outputs for the offline API, and the
metrics and stats through which the server observes it without the engine knowing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely alternatives, best first
    rank: int | None = None  # 1 + how many tokens were likelier (set where asked: prompt scores)


@dataclass(slots=True)
class SequenceDelta:
    """What one sample of a request produced since its previous delta (one engine step, usually one token)."""

    request_id: str  # the request's id, shared by its n samples
    text: str  # new text, safe to show: never a broken UTF-8 piece, never part of a stop string
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop", "length" or "abort" once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    error: str | None = None  # set with finish_reason "abort" when the engine refused the request
    # with params.prompt_logprobs, on the delta of the first output token: one entry per prompt token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's samples (engine/parallel_sampling.py)
    # the request's last delta: every sample has delivered its final one (engine/parallel_sampling.py counts)
    request_finished: bool = False
    # a pooling request's result, on its final delta: the embedding, or [score] (engine/pooling_spec.py)
    pooled: list[float] | None = None

    @classmethod
    def aborted(cls, request_id: str, index: int, error: str | None = None,
                request_finished: bool = False) -> SequenceDelta:
        """The final delta of sample `index` when it is aborted with nothing more to show: by the client, or,
        with `error`, by an engine that refused or lost the request."""
        return cls(request_id, "", [], None, "abort", None, 0, 0, 0, error=error, index=index,
                   request_finished=request_finished)


def abort_deltas(request_id: str, indices: list[int], error: str | None = None) -> list[SequenceDelta]:
    """The final "abort" deltas of the samples `indices` (all those still running), the last one finishing the
    request."""
    return [SequenceDelta.aborted(request_id, index, error, request_finished=index == indices[-1])
            for index in indices]


@dataclass(slots=True)
class CompletionOutput:
    """One sample's output so far: every delta it produced, folded in by `add`."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class RequestOutput:
    """One request's outputs: a `CompletionOutput` per sample, and what its prompt got."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens sample 0 found in the prefix cache (usage counts a prompt once)
    finished: bool = True
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs

    @classmethod
    def empty(cls, request_id: str, prompt_token_ids: list[int], num_samples: int,
              prompt: str | None = None) -> RequestOutput:
        """Before any delta: `num_samples` empty outputs, unfinished."""
        return cls(request_id, prompt, prompt_token_ids, [CompletionOutput(i) for i in range(num_samples)],
                   finished=False)

    def add(self, delta: SequenceDelta) -> None:
        """Fold in one delta of this request: its sample's text, tokens and logprobs, the prompt's."""
        self.outputs[delta.index].add(delta)
        if delta.index == 0:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:  # the same for every sample of the prompt
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.request_finished:
            self.finished = True


@dataclass(slots=True)
class RequestMetrics:
    """Timings (time.monotonic seconds) and counts of one finished sequence, for metrics and logs."""

    request_id: str  # the request's id: its samples share it (`index` tells them apart)
    arrival_time: float
    first_scheduled_time: float | None  # None if it never left the waiting queue
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str
    num_preemptions: int
    index: int = 0  # which of the request's samples


class EngineObserver(Protocol):
    def on_request_finished(self, metrics: RequestMetrics) -> None:
        """Called on the engine's thread once per sequence, whether it finished, stopped or was aborted."""
        ...


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine, cheap to take: gauges plus monotonically increasing counters."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_free_pages: int
    num_cached_pages: int  # held by the radix tree (shared or evictable)
    kv_cache_usage: float  # fraction of pages not free (owned by requests or held by the tree)
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int  # of those, tokens found cached
    prompt_tokens_total: int
    generation_tokens_total: int
    # speculative decoding (vLLM's spec_decode counters): decodes that verified drafts, drafts, kept drafts
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    # per draft position (0: the first draft after the decode's token), drafts verified there and drafts kept
    # (vLLM's spec_decode_num_accepted_tokens_per_pos): acceptance falls with the position
    spec_decode_num_draft_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # the state pool of linear-attention layers (one slot per running sequence); 0 for attention-only models
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    # LoRA (vLLM's vllm:lora_requests_info): adapters of running and of waiting sequences; max_lora 0: LoRA off
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # a hybrid model's prefix cache: its state snapshots, those attached to the radix tree, their memory, and
    # how many were evicted alone (their K/V pages stayed cached)
    num_state_snapshots: int = 0
    num_state_snapshots_attached: int = 0
    state_snapshot_bytes: int = 0
    state_snapshots_evicted_total: int = 0


@dataclass(frozen=True, slots=True)
class PageAccounting:
    """Where every KV page is, for leak checks (soak tests, `GET /debug/engine`)."""

    num_pages: int
    num_free: int
    num_cached: int  # held by the radix tree
    num_locked: int  # tree pages pinned by live requests (0 once everything finished)
    num_owned: int  # private pages of live sequences
    num_sequences: int  # live sequences (waiting, running or preempted)
    integrity_error: str | None  # None when free + cached + owned == num_pages and nothing is shared wrongly


class ProfilerStateError(ValueError):
    """A start while a profile runs, or a stop while none does (the routes' 409)."""


@dataclass(frozen=True, slots=True)
class ProfileFiles:
    """What stopping a step profile wrote (engine/step_profiler.py), as `POST /stop_profile` answers it."""

    trace: str  # the gzipped Chrome trace, an absolute path
    summary: str  # the text summary, an absolute path
    num_steps: int  # engine steps finished while the profile ran
    wall_s: float  # from start to stop
    gpu_busy_fraction: float | None  # the GPU's kernel time over the wall time; None off CUDA


@dataclass(slots=True)
class SpeculationCounts:
    """Running totals of draft verification, for `EngineStats` and the acceptance rate."""

    num_drafts: int = 0  # decodes that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_tokens_per_position: list[int] = field(default_factory=list)
    accepted_tokens_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        missing = num_draft_tokens - len(self.draft_tokens_per_position)
        if missing > 0:
            self.draft_tokens_per_position.extend([0] * missing)
            self.accepted_tokens_per_position.extend([0] * missing)
        for position in range(num_draft_tokens):
            self.draft_tokens_per_position[position] += 1
            self.accepted_tokens_per_position[position] += position < num_accepted_tokens


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # by label id

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's result from the offline `LLM.embed` / `LLM.score` / `LLM.classify` (vLLM's
    EmbeddingRequestOutput, ScoringRequestOutput and ClassificationRequestOutput: the vector, score or probabilities
    are `outputs.embedding` / `outputs.score` / `outputs.probs`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput | ClassificationOutput
    finished: bool = True
