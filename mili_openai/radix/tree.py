"""The radix prefix cache: page-aligned token prefixes mapped to the KV pages that hold them.

Requests whose prompts share a prefix share its pages read-only. A request matches its prompt, locks the
matched node (pinning the path up to the root), and later inserts its own full pages so others can reuse
them. Unlocked nodes stay cached until the pool runs short; then least-recently-used leaves are evicted.

All state is plain Python owned by the engine's event loop (no locks, no torch). Page counters are kept
incrementally because the scheduler reads them every step; eviction, which is rare, scans for leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Optional

from mili_openai.radix.integrity import find_integrity_problem
from mili_openai.radix.page_pool import PagePool
from mili_openai.radix.snapshots import SnapshotStore


class RadixNode:
    """A page-aligned run of tokens and the KV pages that hold them.

    The node's full prefix is the concatenation of `key`s from the root down to it. `key` holds
    `len(pages) * page_size` tokens; the root has an empty key and no pages. Children are keyed by their
    first page of tokens (a tuple of page_size ints), so a lookup costs one dict probe per node.
    """

    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access", "node_id", "snapshot")

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[int],
        parent: Optional[RadixNode],
        last_access: int,
        node_id: int,
    ) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        # How many lock() calls on this node or any descendant are outstanding. A node with
        # lock_ref > 0 is pinned: a running request reads its pages.
        self.lock_ref = 0
        # Logical clock of the last match/insert through this node (LRU order for eviction).
        self.last_access = last_access
        # Creation order; a stable tie-break in the eviction heap.
        self.node_id = node_id
        # A hybrid model's state snapshot id at the end of this node's path (radix/snapshots.py); None: none.
        self.snapshot: Optional[int] = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def is_root(self) -> bool:
        return self.node_id == ROOT_NODE_ID

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_attached(self) -> bool:
        """False once eviction or reset removed the node from its tree (locking it then is a bug)."""
        return self.is_root or self.parent is not None

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, tokens={len(self.key)}, pages={self.pages}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


ROOT_NODE_ID = 0


class PrefixMatch(NamedTuple):
    node: RadixNode  # deepest matched node (the root when nothing matched); lock it to keep the pages
    pages: list[int]  # page ids of the matched prefix, in order
    num_tokens: int  # == len(pages) * page_size
    # match_snapshot's: the tokens whose K/V the tree holds, past the snapshot (== num_tokens for match_prefix)
    kv_tokens: int = 0


class InsertResult(NamedTuple):
    node: RadixNode  # node whose path from the root is exactly the inserted prefix
    # The tree's page ids for the whole inserted prefix, in order. Where one differs from the page the
    # caller passed, the caller's page was a duplicate (the tree already held that prefix) and stays
    # the caller's to free.
    pages: list[int]
    num_new_pages: int  # how many of the caller's pages the tree adopted (they stop being the caller's)


class RadixCache:
    def __init__(self, page_size: int, pool: PagePool, snapshots: Optional[SnapshotStore] = None) -> None:
        """snapshots: where a hybrid model's state snapshots are kept (None for a model without linear layers)."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.pool = pool
        self.snapshots = snapshots
        # Logical LRU clock: every match/insert stamps its path with a fresh tick (never wall time, so
        # the order is exact and tests are deterministic).
        self._clock = 0
        self._next_node_id = ROOT_NODE_ID + 1
        self.root = RadixNode(key=(), pages=[], parent=None, last_access=0, node_id=ROOT_NODE_ID)
        self._cached_pages = 0
        self._locked_pages = 0

    # ---- counters (O(1): the scheduler reads them every step) ----

    @property
    def cached_pages(self) -> int:
        """Pages held by the tree, locked or not."""
        return self._cached_pages

    @property
    def locked_pages(self) -> int:
        """Pages in nodes some running request has locked (directly or through a descendant)."""
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes. A parent's lock count covers its children's, so every descendant of
        an unlocked node is unlocked too: repeated leaf eviction can free all of these."""
        return self._cached_pages - self._locked_pages

    # ---- lookup and insertion ----

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached page-aligned prefix of tokens; a partial last page never matches.

        Splits a node at a page boundary when the match ends inside it, so the returned node's path is
        exactly the match and locking it pins nothing beyond. Refreshes the path's LRU recency.
        """
        aligned = len(tokens) - len(tokens) % self.page_size
        node, pages, num_tokens = self._descend(tuple(tokens[:aligned]), self._tick())
        return PrefixMatch(node, pages, num_tokens, num_tokens)

    def match_snapshot(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached page-aligned prefix of tokens that ends at a node holding a state snapshot (the
        root, with nothing matched, when none does): what a hybrid model may resume from."""
        deepest = self.match_prefix(tokens)
        node = deepest.node
        while not node.is_root and node.snapshot is None:
            node = node.parent
        path = []
        walk = node
        while not walk.is_root:
            path.append(walk)
            walk = walk.parent
        pages = [page for walk in reversed(path) for page in walk.pages]
        return PrefixMatch(node, pages, len(pages) * self.page_size, deepest.num_tokens)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache tokens (a whole number of pages) held in pages; see InsertResult for who owns what.

        The caller keeps its lock on whatever node it held: lock the returned node and unlock the old
        one to move its pin onto the newly cached pages.
        """
        pages = list(pages)
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(
                f"insert needs len(tokens) == len(pages) * page_size, got {len(tokens)} tokens, "
                f"{len(pages)} pages, page_size {self.page_size}"
            )
        if len(set(pages)) != len(pages):
            repeated = sorted({page for page in pages if pages.count(page) > 1})
            raise ValueError(f"insert got page ids twice: {repeated[:8]}")
        free = [page for page in pages if self.pool.is_free(page)]  # is_free rejects unknown ids
        if free:
            raise ValueError(f"insert got pages that are free in the pool (not the caller's): {free[:8]}")

        key = tuple(tokens)
        stamp = self._tick()
        node, tree_pages, matched_tokens = self._descend(key, stamp)
        if matched_tokens == len(key):
            return InsertResult(node, tree_pages, 0)
        adopted = pages[matched_tokens // self.page_size :]
        leaf = self._new_node(key[matched_tokens:], adopted, node, stamp)
        node.children[leaf.key[: self.page_size]] = leaf
        # The new leaf starts unlocked (evictable) even under a locked parent: the caller moves its
        # pin onto it with lock(result.node).
        self._cached_pages += len(adopted)
        tree_pages.extend(adopted)
        return InsertResult(leaf, tree_pages, len(adopted))

    # ---- pinning ----

    def lock(self, node: RadixNode) -> None:
        """Pin node's path: its count and every ancestor's go up by one (the root is not counted)."""
        if not node.is_attached:
            raise ValueError(f"cannot lock {node!r}: it was evicted from the tree")
        while not node.is_root:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one lock(node); ValueError (changing nothing) if node is not locked."""
        if node.is_root:
            return
        if node.lock_ref <= 0:
            # Ancestors hold at least node's count, so checking node alone covers the whole path.
            raise ValueError(f"unlock of {node!r} would make its lock count negative")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent

    # ---- eviction ----

    def evict(self, num_pages: int) -> int:
        """Free least-recently-used unlocked leaves into the pool until num_pages were freed or nothing
        is evictable; a parent left childless and unlocked becomes a leaf in turn. Whole nodes go, so
        this may free a little more than asked. Returns the pages freed."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if num_pages == 0 or self.evictable_pages == 0:
            return 0
        # (last_access, node_id) is unique per node, so the heap never compares nodes themselves.
        # Leaves without a snapshot first: a hybrid model cannot resume from their pages (for other models no
        # node holds one, and the order is plain LRU).
        heap = [
            (node.snapshot is not None, node.last_access, node.node_id, node)
            for node in self._iter_nodes()
            if node.is_leaf and node.lock_ref == 0 and not node.is_root
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            *_, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove_leaf(node)
            if not parent.is_root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.snapshot is not None, parent.last_access, parent.node_id, parent))
        return freed

    def ensure_free(self, num_pages: int) -> bool:
        """Evict until the pool has num_pages free; True if that was reached."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        shortfall = num_pages - self.pool.num_free
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.num_free >= num_pages

    def reset(self) -> None:
        """Drop every node, returning its pages to the pool; ValueError (changing nothing) if any is locked."""
        if self._locked_pages:
            raise ValueError(f"cannot reset the prefix cache: {self._locked_pages} pages are locked")
        nodes = [node for node in self._iter_nodes() if not node.is_root]
        for node in nodes:
            if self.snapshots is not None:
                self.snapshots.detach(node)
            node.parent = None  # marks it detached: lock() on a stale handle then fails loudly
            node.children = {}
        self.root.children = {}
        self.pool.free(page for node in nodes for page in node.pages)
        self._cached_pages = 0

    # ---- checking ----

    def check_integrity(self, owned: Iterable[Sequence[int]] = (), held_snapshots: Iterable[int] = ()) -> None:
        """RuntimeError saying what is wrong unless pool, tree and the callers' owned pages account for
        every page exactly once and the tree's structure, lock counts and counters are consistent; likewise
        the snapshot ids, with those the callers hold (`held_snapshots`)."""
        problem = find_integrity_problem(self, owned)
        if problem is None and self.snapshots is not None:
            problem = self.snapshots.find_integrity_problem(self._iter_nodes(), held_snapshots)
        if problem is not None:
            raise RuntimeError(f"radix cache integrity: {problem}")

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node, the root first, parents before children (a snapshot-free walk: do not mutate)."""
        return self._iter_nodes()

    # ---- internals ----

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _descend(self, key: tuple[int, ...], stamp: int) -> tuple[RadixNode, list[int], int]:
        """Follow key (page-aligned) down from the root while whole pages match, splitting the last node
        at the page boundary where the match ends, and stamp the matched nodes with `stamp`. Returns the
        deepest node (whose path is exactly the matched prefix), the matched pages and token count."""
        page_size = self.page_size
        node = self.root  # never evicted, so its recency is never stamped
        pages: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + page_size])
            if child is None:
                break
            matched = self._matched_length(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = stamp
            pages.extend(child.pages)
            pos += matched
            node = child
        return node, pages, pos

    def _matched_length(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Tokens of node_key matching key[pos:], in whole pages; the first page is known to match."""
        if key[pos : pos + len(node_key)] == node_key:
            return len(node_key)  # the common case (a whole node) costs one C-level tuple compare
        page_size = self.page_size
        limit = min(len(node_key), len(key) - pos)
        matched = page_size
        while matched < limit:
            if key[pos + matched : pos + matched + page_size] != node_key[matched : matched + page_size]:
                break
            matched += page_size
        return matched

    def _split(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """Cut node after num_tokens (a page boundary) into a new parent holding the head; node keeps
        the tail and its identity, so locks held on it still pin the same full path."""
        page_size = self.page_size
        num_head_pages = num_tokens // page_size
        head = self._new_node(node.key[:num_tokens], node.pages[:num_head_pages], node.parent, node.last_access)
        # The head lies on every path that went through node, so it inherits node's count exactly and
        # the page counters (locked/evictable) do not change.
        head.lock_ref = node.lock_ref
        node.parent.children[head.key[:page_size]] = head
        node.key = node.key[num_tokens:]
        node.pages = node.pages[num_head_pages:]
        node.parent = head
        head.children[node.key[:page_size]] = node
        return head

    def _new_node(self, key: tuple[int, ...], pages: list[int], parent: RadixNode, stamp: int) -> RadixNode:
        node = RadixNode(key=key, pages=pages, parent=parent, last_access=stamp, node_id=self._next_node_id)
        self._next_node_id += 1
        return node

    def _remove_leaf(self, node: RadixNode) -> int:
        """Detach an unlocked leaf and free its pages; returns how many."""
        del node.parent.children[node.key[: self.page_size]]
        node.parent = None
        if self.snapshots is not None:
            self.snapshots.detach(node)
        self.pool.free(node.pages)
        self._cached_pages -= len(node.pages)
        return len(node.pages)

    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, cached_pages={self.cached_pages}, "
            f"locked_pages={self.locked_pages}, free_pages={self.pool.num_free})"
        )
