"""State snapshots of hybrid models attached to radix nodes: which snapshot ids exist, which node holds each.

A model with linear-attention layers (Qwen3.5, Qwen3-Next) cannot resume a prefix from its K/V pages alone: each
linear layer's state depends on the whole prefix. A snapshot is that state (every linear layer's conv window and
fp32 recurrent matrix) at the end of one radix node's path, a page boundary; the engine keeps it in a slot of
the state pool (model/state_cache.py) numbered by the ids handed out here. This module only does the
bookkeeping, in plain Python: an id is free, held by a running sequence (saved, not yet attached: the caller's,
passed to `check_integrity`), or attached to exactly one node. A node holds at most one snapshot.

Eviction: a node evicted from the tree frees its snapshot (`RadixCache` calls `detach`), and when no id is free
`reserve` takes one attached snapshot alone (its node keeps its K/V pages but no longer serves as a resume point):
the least recently used of those with another snapshot deeper on their path, else the least recently used. A
request that reaches the deeper one resumes there, so the shallower one serves only prompts that leave the path
in between; and recency alone cannot tell them apart, since a match touches every node of its path. Under plain
LRU, 16 multi-turn conversations with 64 snapshots lost every snapshot of the conversations waiting longest for
their next turn (12 of 112 turns resumed from nothing; none with this order).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Protocol

from mili_openai.radix.page_pool import PagePool


class SnapshotNode(Protocol):
    """What the store reads and writes of a `RadixNode`."""

    snapshot: Optional[int]
    last_access: int
    node_id: int
    parent: Optional[SnapshotNode]


class SnapshotStore:
    def __init__(self, num_snapshots: int, first_id: int = 0) -> None:
        """Ids first_id .. first_id + num_snapshots - 1 (the state pool's slots past the running sequences')."""
        self._pool = PagePool(num_snapshots)  # a free list of 0-based indices with double-free checks
        self.first_id = first_id
        self._attached: dict[int, SnapshotNode] = {}  # snapshot id -> the node holding it
        self.num_evicted_alone = 0  # snapshots evicted while their node stayed cached

    @property
    def num_snapshots(self) -> int:
        return self._pool.num_pages

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_attached(self) -> int:
        return len(self._attached)

    def reserve(self) -> Optional[int]:
        """A free snapshot id, evicting the least recently used attached snapshot if none is free; None when
        every id is held by a running sequence."""
        if self._pool.num_free == 0 and not self._evict_one():
            return None
        return self._pool.allocate(1)[0] + self.first_id

    def release(self, snapshot_id: int) -> None:
        """Give back an id that was reserved but never attached."""
        self._pool.free([snapshot_id - self.first_id])

    def attach(self, node: SnapshotNode, snapshot_id: int) -> bool:
        """Attach a reserved id to node; False (the id released) when node already holds a snapshot, which
        describes the same state."""
        if node.snapshot is not None:
            self.release(snapshot_id)
            return False
        node.snapshot = snapshot_id
        self._attached[snapshot_id] = node
        return True

    def detach(self, node: SnapshotNode) -> None:
        """Free node's snapshot, if it holds one (its node is evicted, or the snapshot alone)."""
        if node.snapshot is not None:
            del self._attached[node.snapshot]
            self.release(node.snapshot)
            node.snapshot = None

    def _evict_one(self) -> bool:
        if not self._attached:
            return False
        shallower = self._with_a_deeper_snapshot()
        victim = min(self._attached.values(),
                     key=lambda node: (node.snapshot not in shallower, node.last_access, node.node_id))
        self.detach(victim)
        self.num_evicted_alone += 1
        return True

    def _with_a_deeper_snapshot(self) -> set[int]:
        """Ids of the attached snapshots that have another attached snapshot below them in the tree."""
        found: set[int] = set()
        for node in self._attached.values():
            ancestor = node.parent
            while ancestor is not None:
                if ancestor.snapshot is not None:
                    if ancestor.snapshot in found:
                        break  # an earlier walk went on from here to the root
                    found.add(ancestor.snapshot)
                ancestor = ancestor.parent
        return found

    def find_integrity_problem(self, nodes: Iterable[SnapshotNode], held: Iterable[int]) -> Optional[str]:
        """None if free ids, the nodes' snapshots and the ids running sequences hold (`held`) account for every
        id exactly once; otherwise a sentence saying what is wrong."""
        try:
            self._pool.check_integrity()
        except RuntimeError as error:
            return f"snapshots: {error}"
        seen: dict[int, str] = {index + self.first_id: "free" for index in self._pool.free_page_ids()}
        in_tree = [(node.snapshot, f"node {node.node_id}") for node in nodes if node.snapshot is not None]
        for snapshot_id, holder in [*in_tree, *((snapshot_id, "a sequence") for snapshot_id in held)]:
            if not self.first_id <= snapshot_id < self.first_id + self.num_snapshots:
                return f"snapshots: {holder} holds unknown id {snapshot_id}"
            if snapshot_id in seen:
                return f"snapshots: id {snapshot_id} is held twice: by {seen[snapshot_id]} and by {holder}"
            seen[snapshot_id] = holder
        if len(in_tree) != len(self._attached):
            return f"snapshots: {len(self._attached)} recorded as attached, {len(in_tree)} found on nodes"
        if len(seen) != self.num_snapshots:
            return f"snapshots: free + attached + held = {len(seen)}, the store has {self.num_snapshots}"
        return None
