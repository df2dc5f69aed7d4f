"""A full recount of the page pool and the radix tree, for tests and debug checks (O(pages + nodes)).

Kept apart from the tree so the hot-path module reads as the algorithm alone. Returns a description of
the first problem found instead of raising, so the tree chooses the exception (RuntimeError) and tests
can assert on the message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Mapping
from typing import Optional, Protocol

from mili_openai.radix.page_pool import PagePool


class CheckedNode(Protocol):
    """What the check reads of a `RadixNode` (typed here so that tree.py imports this module, not the reverse)."""

    key: Sequence[int]
    pages: Sequence[int]
    lock_ref: int
    parent: Optional[CheckedNode]
    children: Mapping[tuple[int, ...], CheckedNode]

    @property
    def is_root(self) -> bool: ...


class CheckedTree(Protocol):
    """What the check reads of a `RadixCache`."""

    page_size: int
    root: CheckedNode
    pool: PagePool

    @property
    def cached_pages(self) -> int: ...

    def iter_nodes(self) -> Iterable[CheckedNode]: ...

# How many offending page ids a message lists before it stops.
MAX_PAGES_IN_MESSAGE = 8


def find_integrity_problem(cache: CheckedTree, owned: Iterable[Sequence[int]]) -> Optional[str]:
    """None if all is well, otherwise a sentence saying what is wrong."""
    try:
        cache.pool.check_integrity()
    except RuntimeError as error:
        return str(error)
    problem = _structure_problem(cache)
    if problem is not None:
        return problem
    return _accounting_problem(cache, [list(pages) for pages in owned])


def _structure_problem(cache: CheckedTree) -> Optional[str]:
    page_size = cache.page_size
    root = cache.root
    if root.key or root.pages or root.parent is not None or root.lock_ref != 0:
        return f"root must have no key, no pages, no parent and lock count 0: {root!r}"
    cached = 0
    locked = 0
    for node in cache.iter_nodes():
        if not node.is_root:
            if not node.pages or len(node.key) != len(node.pages) * page_size:
                return (
                    f"{node!r}: key length {len(node.key)} is not a positive "
                    f"{len(node.pages)} pages x page_size {page_size}"
                )
            if node.lock_ref < 0:
                return f"{node!r}: negative lock count"
            cached += len(node.pages)
            if node.lock_ref > 0:
                locked += len(node.pages)
        problem = _children_problem(node, page_size)
        if problem is not None:
            return problem
    if cached != cache.cached_pages:
        return f"cached_pages counter says {cache.cached_pages}, recount says {cached}"
    if locked != cache.locked_pages:
        return f"locked_pages counter says {cache.locked_pages}, recount says {locked}"
    if cached - locked != cache.evictable_pages:
        return f"evictable_pages counter says {cache.evictable_pages}, recount says {cached - locked}"
    return None


def _children_problem(node: CheckedNode, page_size: int) -> Optional[str]:
    children_locks = 0
    for first_page, child in node.children.items():
        if child.parent is not node:
            return f"{child!r}: parent link does not point at the node holding it"
        if child.key[:page_size] != first_page:
            return f"{child!r}: stored under key {first_page}, but its first page is {child.key[:page_size]}"
        children_locks += child.lock_ref
    # Every lock on a child also counted on its parent; the root is never counted.
    if not node.is_root and node.lock_ref < children_locks:
        return f"{node!r}: lock count {node.lock_ref} is below its children's total {children_locks}"
    return None


def _accounting_problem(cache: CheckedTree, owned: list[list[int]]) -> Optional[str]:
    num_pages = cache.pool.num_pages
    holders: dict[int, str] = {}
    everything: list[tuple[str, Iterable[int]]] = [("free", cache.pool.free_page_ids())]
    everything.append(("tree", (page for node in cache.iter_nodes() for page in node.pages)))
    everything.extend((f"owned[{index}]", pages) for index, pages in enumerate(owned))
    for holder, pages in everything:
        for page in pages:
            if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < num_pages:
                return f"{holder} holds unknown page id {page!r} (pool has 0..{num_pages - 1})"
            if page in holders:
                return f"page {page} is held twice: by {holders[page]} and by {holder}"
            holders[page] = holder
    total = cache.pool.num_free + cache.cached_pages + sum(len(pages) for pages in owned)
    if total != num_pages:
        missing = sorted(set(range(num_pages)) - holders.keys())[:MAX_PAGES_IN_MESSAGE]
        return f"free + tree + owned = {total} pages, pool has {num_pages}; unaccounted pages include {missing}"
    return None
