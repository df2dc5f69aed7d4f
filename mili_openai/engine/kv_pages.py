"""Page bookkeeping for sequences: prefix matching, allocation, caching into the radix tree, release.

Owns the page pool and the radix tree (plain Python, no torch). Every page is free, owned by exactly
one sequence (`Sequence.owned_pages`), or held by the tree; `check_integrity` verifies it. The tree's keys are
`Sequence.cache_key`s: token ids, shifted per LoRA adapter, an image's placeholders replaced by its digest. For a model with
linear-attention layers the tree also holds state snapshots (`snapshots`, engine/state_snapshots.py), and a
sequence matches only a prefix that ends at one: never K/V alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from mili_openai.config import EngineConfig
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.state_snapshots import StateSnapshots
from mili_openai.radix import PagePool, RadixCache, SnapshotStore


# A hybrid prompt's end costs its first token a step to save (StateSnapshots.prompt_stop): for a prompt that resumed
# from a cached prefix, worth it only where a later prompt on its path would otherwise compute at least this share
# of a step's token budget again past that prefix. Multi-turn
# chats on a CPU (16 at once, 512-token steps): TTFT p50 -40% in a step-cost simulation, the hit rate unchanged.
PROMPT_SAVE_BUDGET_SHARE = 4


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVPageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool,
                 num_snapshots: int = 0, first_snapshot_id: int = 0, snapshot_interval: int | None = None,
                 min_prompt_save: int = 0) -> None:
        """num_snapshots: state snapshots of a hybrid model, ids from first_snapshot_id (0: not a hybrid model);
        snapshot_interval: a prefill also saves its state every that many pages (None: only where needed);
        min_prompt_save: a prompt's end is saved only that many tokens past its cached prefix (StateSnapshots)."""
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        store = SnapshotStore(num_snapshots, first_snapshot_id) if num_snapshots else None
        self.tree = RadixCache(page_size, self.pool, store)
        self.snapshots = (StateSnapshots(store, self.tree, page_size, snapshot_interval, min_prompt_save)
                          if store else None)
        self.enable_prefix_caching = enable_prefix_caching

    @classmethod
    def for_engine(cls, config: EngineConfig, num_pages: int, num_state_slots: int,
                   num_snapshots: int) -> KVPageManager:
        """The engine's: snapshots (of a hybrid model) numbered after its `num_state_slots` running slots."""
        return cls(num_pages, config.page_size, config.enable_prefix_caching, num_snapshots, num_state_slots,
                   config.hybrid_snapshot_interval, config.max_num_batched_tokens // PROMPT_SAVE_BUDGET_SHARE)

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def match(self, seq: Sequence) -> int:
        """Point seq at the longest cached prefix of its tokens and lock it; returns the tokens matched.

        At least one token is left uncached, since the last one must run through the model for logits.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # scoring the prompt needs every prompt position's logits, cached ones included
        key = seq.cache_key(seq.num_tokens - 1)
        if self.snapshots is not None:  # a hybrid model resumes only where a state snapshot was saved
            match = self.tree.match_snapshot(key)
            seq.restore_snapshot = match.node.snapshot
            if match.kv_tokens > match.num_tokens:
                # seq leaves a cached path where no state was saved: save one there as it passes, so the
                # next prompt that shares the path (a system prompt sent again later) resumes from it
                self.snapshots.request_stop(seq, match.kv_tokens, match.num_tokens)
        else:
            match = self.tree.match_prefix(key)
        self.tree.lock(match.node)
        seq.pages = list(match.pages)
        seq.num_tree_pages = len(match.pages)
        seq.tree_node = match.node
        seq.num_computed_tokens = match.num_tokens
        return match.num_tokens

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = pages_for(seq.num_computed_tokens + num_new_tokens, self.page_size)
        return max(0, total - len(seq.pages))

    def allocate(self, seq: Sequence, num_pages: int) -> bool:
        """Give seq num_pages more pages, evicting cached ones if needed; False (nothing done) if short."""
        if num_pages == 0:
            return True
        if not self.tree.ensure_free(num_pages):
            return False
        seq.pages.extend(self.pool.allocate(num_pages))
        return True

    def prefill_chunk(self, seq: Sequence, num_new: int) -> int:
        """How many of num_new prompt tokens seq's next prefill chunk computes: fewer where a hybrid model's
        chunk stops at a page boundary to save its state there (engine/state_snapshots.py)."""
        if self.snapshots is None or not self.enable_prefix_caching or num_new <= 1:
            return num_new
        return self.snapshots.chunk_size(seq, num_new)

    def will_cache(self, seq: Sequence, num_tokens: int, chunk_end: int) -> bool:
        """Whether seq, being prefilled up to chunk_end in this step, will leave its first num_tokens (a page
        boundary) where another sequence can resume from them: its pages, and for a hybrid model a snapshot
        (asked for here)."""
        return self.snapshots is None or self.snapshots.request_stop(seq, num_tokens, chunk_end)

    def cache_computed_pages(self, seq: Sequence) -> None:
        """Hand seq's full computed pages to the tree so other sequences can share them, and its saved state
        snapshot (a hybrid model's) once its pages are there.

        Where the tree already held the same prefix (a sibling computed it in the same step), seq's own
        copy is freed and its page table switched to the tree's pages, which hold identical K/V.
        """
        if not self.enable_prefix_caching:
            return
        self._insert_computed_pages(seq)
        if self.snapshots is not None:
            self.snapshots.attach(seq)

    def _insert_computed_pages(self, seq: Sequence) -> None:
        num_full = seq.num_known_computed_tokens // self.page_size
        if num_full <= seq.num_tree_pages:
            return
        result = self.tree.insert(seq.cache_key(num_full * self.page_size), seq.pages[:num_full])
        duplicates = [
            mine
            for mine, tree_page in zip(seq.pages[seq.num_tree_pages : num_full], result.pages[seq.num_tree_pages :])
            if mine != tree_page
        ]
        if duplicates:
            self.pool.free(duplicates)
        seq.pages[:num_full] = result.pages
        self.tree.lock(result.node)
        if seq.tree_node is not None:
            self.tree.unlock(seq.tree_node)
        seq.tree_node = result.node
        seq.num_tree_pages = num_full

    def settle_drafts(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """seq kept `num_accepted` of the `num_drafts` drafts it verified: its counters, and the state snapshot its
        verify step saved (a hybrid model's), kept or given back."""
        seq.settle_drafts(num_drafts, num_accepted)
        if self.snapshots is not None:
            self.snapshots.settle_verified(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        """Return everything seq holds: full computed pages go to the tree (unlocked), the rest to the pool."""
        self.cache_computed_pages(seq)
        if self.snapshots is not None:
            self.snapshots.release(seq)
        if seq.tree_node is not None:
            self.tree.unlock(seq.tree_node)
        owned = seq.owned_pages
        if owned:
            self.pool.free(owned)
        seq.pages = []
        seq.num_tree_pages = 0
        seq.tree_node = None
        seq.num_computed_tokens = 0

    def check_integrity(self, sequences: Iterable[Sequence]) -> None:
        sequences = list(sequences)
        held = self.snapshots.held(sequences) if self.snapshots is not None else ()
        self.tree.check_integrity(owned=[seq.owned_pages for seq in sequences], held_snapshots=held)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_pages
