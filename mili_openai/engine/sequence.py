"""One sequence's state inside the engine: tokens, KV pages, stopping and timing.

A request with n > 1 is n sequences (the caller fans out); each is scheduled on its own and shares the
prompt's KV pages with its siblings through the radix tree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mili_openai.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from mili_openai.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
    from mili_openai.engine.image_inputs import RequestImages
    from mili_openai.engine.outputs import TokenLogprob
    from mili_openai.radix import RadixNode


# a LoRA sequence's prefix-cache key shifts every token id by its adapter id times this (past any vocabulary),
# so prefixes computed under one adapter (or the base, id 0, unshifted) never match under another
LORA_KEY_STRIDE = 1 << 32


@dataclass(slots=True)
class DraftWindow:
    """A sequence's standing with the adaptive off-switch (engine/proposers.py's `DraftSwitch`): the drafts it
    verified and kept since drafting last (re)started, and, while paused, when it probes again."""

    drafts: int = 0
    accepted: int = 0
    resume_at: int | None = None  # paused until its output is this long (None: drafting)
    pause: int = 0  # the next pause, in output tokens (0: the switch's first)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    sequence_id: str  # this sample's own id (engine/parallel_sampling.py derives it)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    generator: torch.Generator | None  # the request's own sampling stream when seeded
    # params.structured_outputs' ConstrainedOutput (engine/structured_output.py), used on the forward thread only
    grammar: Any = None
    # the request this sequence is a sample of, and which sample (engine/parallel_sampling.py); None: itself
    parent_id: str | None = None
    index: int = 0
    images: RequestImages | None = None  # the prompt's images (engine/image_inputs.py); None: text only
    # a pooling request (engine/pooling_spec.py): prefill only, its vector instead of tokens; its chunks'
    # partial state (a mean's running sum, a CLS vector) lives in pooling_partial until the last chunk
    pooled: bool = False
    pooling_partial: Any = None
    lora_id: int = 0  # the LoRA adapter it runs with (engine/lora_manager.py); 0: the base model alone

    # tokens: prompt followed by outputs. num_computed_tokens counts the tokens whose K/V is in `pages`
    # or is being written by a step already handed to the model runner (steps run in order, so nothing
    # scheduled later can read a slot before it is written). num_pending_tokens counts tokens that such
    # steps are sampling: they follow token_ids but their ids are not known yet (at most one step ahead).
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0

    # KV page table. pages[:num_tree_pages] are held by the radix tree and locked through tree_node;
    # the rest are this sequence's own.
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    tree_node: RadixNode | None = None
    # the state slot of a model with linear-attention layers (engine/state_slots.py); None: holds none
    state_slot: int | None = None
    # a hybrid model's prefix cache (engine/state_snapshots.py): the snapshot id this sequence's state was saved
    # into and at which position, not yet attached to the tree; the snapshot its admission restores from; page
    # boundaries other prompts asked it to save its state at (where they branch off its path)
    snapshot: tuple[int, int] | None = None
    restore_snapshot: int | None = None
    snapshot_stops: list[int] = field(default_factory=list)
    # a save planned in a step verifying drafts: (snapshot id, page boundary, the decode row that reaches it),
    # kept only if that row's token is accepted (StateSnapshots.settle_verified)
    verified_snapshot: tuple[int, int, int] | None = None

    # speculative decoding: the drafts a model proposer (MTP) made in this sequence's last step, for its next
    # (engine/proposers.py), its own tally of drafts verified and accepted, and its off-switch's window
    proposed_drafts: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_window: DraftWindow = field(default_factory=DraftWindow)

    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # with params.prompt_logprobs: entry i scores prompt token i (entry 0 stays None), filled chunk by
    # chunk as the prefill computes them (again, to the same values, when a preemption recomputes them)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.parent_id is None:
            self.parent_id = self.sequence_id
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_known_computed_tokens(self) -> int:
        """Computed tokens whose ids are known: the K/V that pages can be cached under."""
        return min(self.num_computed_tokens, len(self.token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def owned_pages(self) -> list[int]:
        return self.pages[self.num_tree_pages :]

    def cache_key(self, num_tokens: int) -> list[int]:
        """The radix tree's key for the first num_tokens tokens (K/V pages and state snapshots alike): what was
        computed under them depends on the LoRA adapter and on the prompt's images too (RequestImages.key)."""
        tokens = self.token_ids[:num_tokens]
        if self.lora_id:
            offset = self.lora_id * LORA_KEY_STRIDE
            tokens = [token + offset for token in tokens]
        return tokens if self.images is None else self.images.key(tokens, self.lora_id)

    def settle_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """A decode verified num_drafts draft tokens (counted computed when it was scheduled) and kept the
        first num_accepted: the rest's K/V slots go back to uncomputed (the next steps overwrite them), and
        the kept ones join the pending token, as tokens to append."""
        self.num_computed_tokens -= num_drafts - num_accepted
        self.num_pending_tokens += num_accepted
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def append_token(self, token_id: int) -> None:
        """A sampled token came back: it was pending since its step was scheduled."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.num_pending_tokens -= 1
