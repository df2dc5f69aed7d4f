"""The pool of KV-cache pages: which page ids are free right now.

A page id indexes one `page_size`-token slot range in every layer's K/V tensors. The pool only tracks
which ids are free; who holds the others (one request, or the radix tree) is the caller's business and
is checked as a whole by `RadixCache.check_integrity`.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(Exception):
    """Fewer free pages than an allocation asked for; the pool is left unchanged."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        # A stack for O(1) allocate/free plus a set for O(1) membership (double-free detection).
        # Reversed so a fresh pool hands out 0, 1, 2, ... which keeps early tests and logs readable.
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_set: set[int] = set(self._free_stack)

    @property
    def num_free(self) -> int:
        return len(self._free_stack)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free pages; raises OutOfPages (taking nothing) if fewer are free."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        if count > len(self._free_stack):
            raise OutOfPages(f"asked for {count} pages, only {len(self._free_stack)} free of {self.num_pages}")
        if count == 0:
            return []
        pages = self._free_stack[-count:]
        del self._free_stack[-count:]
        pages.reverse()  # pop order: lowest id first on a fresh pool
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; ValueError (freeing nothing) on an unknown id or a double free."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            self._check_id(page)
            if page in self._free_set:
                raise ValueError(f"double free: page {page} is already free")
            if page in seen:
                raise ValueError(f"double free: page {page} appears twice in one free() call")
            seen.add(page)
        self._free_stack.extend(pages)
        self._free_set.update(pages)

    def is_free(self, page: int) -> bool:
        self._check_id(page)
        return page in self._free_set

    def free_page_ids(self) -> list[int]:
        """A snapshot of the free page ids (for integrity checks and debugging, not the hot path)."""
        return list(self._free_stack)

    def check_integrity(self) -> None:
        """RuntimeError unless the free stack and the free set describe the same pages, each once."""
        if len(self._free_stack) != len(self._free_set) or set(self._free_stack) != self._free_set:
            raise RuntimeError("page pool: free stack and free set disagree (a page is listed twice)")
        bad = [page for page in self._free_set if not 0 <= page < self.num_pages]
        if bad:
            raise RuntimeError(f"page pool: free pages out of range 0..{self.num_pages - 1}: {sorted(bad)[:8]}")

    def _check_id(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"unknown page id {page!r} (pool has pages 0..{self.num_pages - 1})")

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self.num_pages}, num_free={self.num_free})"
