"""RadixCache: unit tests per operation (the stateful model of requests is in test_radix_tree_stateful)."""

from __future__ import annotations

import os
import sys

import pytest

import mili_openai.radix as radix_package
from mili_openai.radix import InsertResult, PagePool, PrefixMatch, RadixCache, RadixNode

PAGE = 4  # page size of the unit tests


def make_cache(num_pages: int = 16, page_size: int = PAGE) -> RadixCache:
    return RadixCache(page_size, PagePool(num_pages))


def cache_tokens(cache: RadixCache, tokens: list[int]) -> InsertResult:
    """Insert tokens as a finished request would: fresh pages, duplicates freed."""
    pages = cache.pool.allocate(len(tokens) // cache.page_size)
    result = cache.insert(tokens, pages)
    cache.pool.free(mine for mine, kept in zip(pages, result.pages) if mine != kept)
    return result


# ---- match ----


def test_match_on_empty_tree_returns_root_and_nothing() -> None:
    cache = make_cache()
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert isinstance(match, PrefixMatch)
    assert match.node is cache.root and match.pages == [] and match.num_tokens == 0
    assert cache.match_prefix([]).num_tokens == 0
    cache.check_integrity()


def test_partial_page_of_the_prompt_never_matches() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(8)))  # two full pages
    assert cache.match_prefix(list(range(8)) + [99]).pages == stored.pages
    assert cache.match_prefix(list(range(7))).pages == stored.pages[:1]
    assert cache.match_prefix(list(range(3))).num_tokens == 0
    assert cache.match_prefix([0, 1, 2, 9, 4, 5, 6, 7]).num_tokens == 0  # first page differs
    cache.check_integrity()


def test_match_splits_a_node_at_the_page_boundary() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(12)))  # one node of three pages
    match = cache.match_prefix(list(range(8)) + [50, 51, 52, 53])
    assert match.pages == stored.pages[:2] and match.num_tokens == 8
    assert match.node.key == tuple(range(8)) and match.node.parent is cache.root
    (tail,) = match.node.children.values()
    assert tail is stored.node and tail.pages == stored.pages[2:]  # the deep node keeps its identity
    # Locking the split node pins exactly the matched pages: the tail page stays evictable.
    cache.lock(match.node)
    assert cache.locked_pages == 2 and cache.evictable_pages == 1
    assert cache.evict(10) == 1
    assert cache.match_prefix(list(range(12))).pages == stored.pages[:2]
    cache.check_integrity()


def test_split_under_a_lock_keeps_counts_and_the_lock_on_the_deep_node() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(12)))
    cache.lock(stored.node)
    cache.match_prefix(list(range(4)) + [70, 71, 72, 73])  # splits the locked node after one page
    assert stored.node.lock_ref == 1 and stored.node.parent.lock_ref == 1
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    cache.check_integrity()
    cache.unlock(stored.node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 3
    cache.check_integrity()


class RadixLineCounter:
    """Counts the Python lines run inside mili_openai/radix while active: a measure of work that does not
    depend on how fast or busy the machine is."""

    def __init__(self) -> None:
        self.lines = 0
        self.radix_dir = os.path.dirname(radix_package.__file__)
        self._previous = None

    def _local(self, frame, event, arg):  # noqa: ANN001, ANN202 (sys.settrace's signature)
        if event == "line":
            self.lines += 1
        return self._local

    def _global(self, frame, event, arg):  # noqa: ANN001, ANN202
        return self._local if frame.f_code.co_filename.startswith(self.radix_dir) else None

    def __enter__(self) -> RadixLineCounter:
        self._previous = sys.gettrace()  # a coverage tool's or a debugger's, handed back on exit
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)


def test_long_prompt_match_and_insert_work_per_page_not_per_token() -> None:
    page_size, num_tokens = 16, 32 * 1024
    cache = make_cache(num_pages=2 * num_tokens // page_size + 1, page_size=page_size)
    prompt = [index % 1000 for index in range(num_tokens)]
    variant = prompt[:-1] + [5000]  # differs only in the last page: the match walks every page
    with RadixLineCounter() as counter:
        cache_tokens(cache, prompt)
        assert cache.match_prefix(variant).num_tokens == num_tokens - page_size
        inserted = cache_tokens(cache, variant)
        assert cache.match_prefix(prompt + [1]).num_tokens == num_tokens
    assert inserted.num_new_pages == 1
    assert cache.cached_pages == num_tokens // page_size + 1
    # four walks over the prompt: a per-token Python loop runs at least one line per token per walk
    # (131,072 here); the per-page walks run ~35,000, under half a line per token per walk
    walks = 4
    assert counter.lines < walks * num_tokens // 2, f"{counter.lines} lines for {walks} walks of {num_tokens} tokens"
    cache.check_integrity()


# ---- insert ----


def test_insert_over_an_existing_prefix_returns_the_trees_pages() -> None:
    cache = make_cache()
    first = cache_tokens(cache, list(range(8)))
    mine = cache.pool.allocate(3)
    result = cache.insert(list(range(12)), mine)
    assert result.pages[:2] == first.pages and result.pages[2] == mine[2]
    assert result.num_new_pages == 1
    assert result.node.key == tuple(range(8, 12)) and result.node.parent is first.node
    cache.check_integrity(owned=[mine[:2]])  # the two duplicates are still the caller's
    cache.pool.free(mine[:2])
    cache.check_integrity()


def test_insert_of_a_fully_cached_prefix_adopts_nothing() -> None:
    cache = make_cache()
    first = cache_tokens(cache, list(range(12)))
    mine = cache.pool.allocate(2)
    result = cache.insert(list(range(8)), mine)
    assert result.num_new_pages == 0 and result.pages == first.pages[:2]
    assert result.node.key == tuple(range(8))  # split so the node's path is exactly the prefix
    cache.check_integrity(owned=[mine])


def test_insert_rejects_mismatched_lengths_and_foreign_pages() -> None:
    cache = make_cache()
    pages = cache.pool.allocate(2)
    with pytest.raises(ValueError, match="len"):
        cache.insert(list(range(7)), pages)
    with pytest.raises(ValueError, match="free"):
        cache.insert(list(range(8)), [pages[0], 15])  # page 15 is free: not the caller's to give
    with pytest.raises(ValueError, match="twice"):
        cache.insert(list(range(8)), [pages[0], pages[0]])
    assert cache.cached_pages == 0
    cache.check_integrity(owned=[pages])


def test_insert_empty_prefix_is_a_no_op() -> None:
    cache = make_cache()
    result = cache.insert([], [])
    assert result == InsertResult(cache.root, [], 0)


# ---- lock / unlock ----


def test_lock_prevents_eviction_until_unlocked() -> None:
    cache = make_cache(num_pages=4)
    stored = cache_tokens(cache, list(range(16)))
    cache.lock(stored.node)
    assert cache.locked_pages == 4 and cache.evictable_pages == 0
    assert cache.evict(4) == 0 and not cache.ensure_free(1)
    cache.unlock(stored.node)
    assert cache.ensure_free(4) and cache.cached_pages == 0
    cache.check_integrity()


def test_locks_nest_and_unlock_underflow_raises() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(8)))
    cache.lock(stored.node)
    cache.lock(stored.node)
    cache.unlock(stored.node)
    assert cache.locked_pages == 2
    cache.unlock(stored.node)
    with pytest.raises(ValueError, match="negative"):
        cache.unlock(stored.node)
    assert stored.node.lock_ref == 0 and cache.locked_pages == 0
    cache.lock(cache.root)  # the root is never counted: matching nothing then lock/unlock is harmless
    cache.unlock(cache.root)
    cache.check_integrity()


def test_locking_an_evicted_node_raises() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(4)))
    cache.evict(1)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(stored.node)


# ---- eviction ----


def test_eviction_follows_lru_order() -> None:
    cache = make_cache()
    a = cache_tokens(cache, [1] * PAGE)
    b = cache_tokens(cache, [2] * PAGE)
    c = cache_tokens(cache, [3] * PAGE)
    cache.match_prefix([1] * PAGE)  # a is now the most recent; b the least
    assert cache.evict(1) == 1
    assert cache.pool.is_free(b.pages[0])
    assert cache.evict(1) == 1
    assert cache.pool.is_free(c.pages[0]) and not cache.pool.is_free(a.pages[0])
    cache.check_integrity()


def test_parent_is_evicted_only_after_its_children() -> None:
    cache = make_cache()
    trunk = list(range(8))
    left = cache_tokens(cache, trunk + [20] * PAGE)
    right = cache_tokens(cache, trunk + [30] * PAGE)
    parent = left.node.parent
    assert right.node.parent is parent and parent.pages == left.pages[:2]
    cache.match_prefix(trunk)  # the parent is the most recent node, yet only a leaf may go
    assert cache.evict(1) == 1
    assert cache.cached_pages == 3 and not cache.pool.is_free(parent.pages[0])
    assert cache.evict(2) == 3  # the other leaf, then the parent as a whole node
    assert cache.cached_pages == 0 and cache.pool.num_free == 16
    cache.check_integrity()


def test_locked_descendant_pins_the_whole_path() -> None:
    cache = make_cache()
    deep = cache_tokens(cache, list(range(12)))
    sibling = cache_tokens(cache, list(range(8)) + [40] * PAGE)
    cache.lock(deep.node)
    assert cache.evict(16) == 1  # only the sibling leaf is free to go
    assert cache.pool.is_free(sibling.pages[2])
    assert cache.match_prefix(list(range(12))).pages == deep.pages
    cache.unlock(deep.node)
    cache.check_integrity()


def test_ensure_free_and_argument_checks() -> None:
    cache = make_cache(num_pages=4)
    cache_tokens(cache, list(range(12)))
    assert cache.pool.num_free == 1
    assert cache.ensure_free(1) and cache.cached_pages == 3  # enough already: nothing evicted
    assert cache.ensure_free(4) and cache.cached_pages == 0
    assert not cache.ensure_free(5)
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(ValueError):
        cache.ensure_free(-1)
    with pytest.raises(ValueError):
        RadixCache(0, PagePool(4))


# ---- reset and integrity ----


def test_reset_refuses_while_locked_then_drops_everything() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(8)))
    cache_tokens(cache, [9] * 8)
    cache.lock(stored.node)
    with pytest.raises(ValueError, match="locked"):
        cache.reset()
    assert cache.cached_pages == 4
    cache.unlock(stored.node)
    cache.reset()
    assert cache.cached_pages == 0 and cache.pool.num_free == 16
    assert cache.match_prefix(list(range(8))).num_tokens == 0
    with pytest.raises(ValueError):
        cache.lock(stored.node)
    cache.check_integrity()


def test_check_integrity_reports_leaks_and_double_holders() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(8)))
    private = cache.pool.allocate(2)
    cache.check_integrity(owned=[private])
    with pytest.raises(RuntimeError, match="unaccounted"):
        cache.check_integrity()  # the private pages are not declared
    with pytest.raises(RuntimeError, match="held twice"):
        cache.check_integrity(owned=[private, [stored.pages[0]]])


def test_check_integrity_catches_bad_counters_and_locks() -> None:
    cache = make_cache()
    stored = cache_tokens(cache, list(range(12)))
    cache.match_prefix(list(range(4)))  # split: parent (1 page) -> child (2 pages)
    child = stored.node
    child.lock_ref = 1  # a lock that skipped the parent
    with pytest.raises(RuntimeError, match="lock count|locked_pages"):
        cache.check_integrity()
    child.lock_ref = 0
    cache._cached_pages += 1
    with pytest.raises(RuntimeError, match="cached_pages"):
        cache.check_integrity()
    cache._cached_pages -= 1
    child.pages.append(cache.pool.allocate(1)[0])  # key length no longer matches the page count
    with pytest.raises(RuntimeError, match="key length"):
        cache.check_integrity()


def test_exports() -> None:
    import mili_openai.radix as radix

    assert set(radix.__all__) == {"PagePool", "OutOfPages", "RadixCache", "RadixNode", "PrefixMatch", "InsertResult",
                                "SnapshotStore"}
    assert isinstance(make_cache().root, RadixNode)
