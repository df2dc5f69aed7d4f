"""One node of the radix prefix tree: a run of whole pages hanging below its parent's prefix."""

from __future__ import annotations

from typing import Optional


class RadixNode:
    """A page-aligned run of tokens and the KV pages that hold them.

    The node's full prefix is the concatenation of `key`s from the root down to it. `key` holds
    `len(pages) * page_size` tokens; the root has an empty key and no pages. Children are keyed by their
    first page of tokens (a tuple of page_size ints), so a lookup costs one dict probe per node.
    """

    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access", "node_id")

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
