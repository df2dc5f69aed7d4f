"""RadixCache: unit tests per operation, then a stateful model of requests driving pool + tree.

The stateful machine plays the scheduler: requests match their prompt, lock, allocate private pages
(evicting when short), compute, cache their full pages, and finish or abort. An oracle remembers which
token prefix every page holds, so a match returning a page with the wrong K/V fails the test.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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


def test_long_prompt_match_and_insert_are_fast() -> None:
    page_size, num_tokens = 16, 32 * 1024
    cache = make_cache(num_pages=2 * num_tokens // page_size + 1, page_size=page_size)
    prompt = [index % 1000 for index in range(num_tokens)]
    variant = prompt[:-1] + [5000]  # differs only in the last page: the match walks every page
    start = time.perf_counter()
    cache_tokens(cache, prompt)
    assert cache.match_prefix(variant).num_tokens == num_tokens - page_size
    inserted = cache_tokens(cache, variant)
    assert cache.match_prefix(prompt + [1]).num_tokens == num_tokens
    elapsed = time.perf_counter() - start
    assert inserted.num_new_pages == 1
    assert cache.cached_pages == num_tokens // page_size + 1
    # A per-token Python loop would take ~10x longer; this bound is far above the real cost (~10 ms).
    assert elapsed < 1.0, f"32K-token match/insert took {elapsed:.3f} s"
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

    assert set(radix.__all__) == {"PagePool", "OutOfPages", "RadixCache", "RadixNode", "PrefixMatch", "InsertResult"}
    assert isinstance(make_cache().root, RadixNode)


# ---- stateful: requests against pool + tree, the way the scheduler drives them ----


class Request:
    """One simulated sequence: pages[:num_tree_pages] are the tree's (pinned via node), the rest its own."""

    def __init__(self, tokens: list[int], node: RadixNode, pages: list[int], computed: int) -> None:
        self.tokens = tokens
        self.node = node
        self.pages = pages
        self.num_tree_pages = len(pages)
        self.computed = computed

    @property
    def owned(self) -> list[int]:
        return self.pages[self.num_tree_pages :]


# Prompts are a cut of one of a few stems plus a random tail, so requests share prefixes of every
# length (splits, duplicates, siblings) far more often than independent random lists would.
STEMS = ((0, 1, 2, 3) * 4, (0, 1, 2, 3, 3, 2, 1, 0) * 2, (0, 1) * 8, (2,) * 16)
TOKENS = st.builds(
    lambda stem, cut, tail: list(stem[:cut]) + tail,
    st.sampled_from(STEMS),
    st.integers(0, 16),
    st.lists(st.integers(0, 3), max_size=4),
).filter(bool)


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(3, 20))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.cache = RadixCache(page_size, self.pool)
        self.requests: list[Request] = []
        # Oracle: the full token prefix whose K/V each written page holds, and the tree's contents
        # as {page-aligned prefix: page}. A page's K/V depends on every token before it, so a shared
        # page is correct only if its whole prefix matches.
        self.content: dict[int, tuple[int, ...]] = {}
        self.cached: dict[tuple[int, ...], int] = {}

    # -- helpers --

    def forget_evicted(self) -> None:
        self.cached = {prefix: page for prefix, page in self.cached.items() if not self.pool.is_free(page)}

    def expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            page = self.cached.get(tuple(tokens[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def cache_request(self, request: Request) -> None:
        """What the scheduler does after a prefill chunk: hand full computed pages to the tree."""
        num_full = request.computed // self.page_size
        if num_full <= request.num_tree_pages:
            return
        tokens = request.tokens[: num_full * self.page_size]
        result = self.cache.insert(tokens, request.pages[:num_full])
        assert len(result.pages) == num_full
        assert result.pages[: request.num_tree_pages] == request.pages[: request.num_tree_pages]
        duplicates = []
        for index in range(request.num_tree_pages, num_full):
            mine, kept = request.pages[index], result.pages[index]
            assert self.content[kept] == tuple(tokens[: (index + 1) * self.page_size])
            if mine != kept:
                duplicates.append(mine)
        assert result.num_new_pages == num_full - request.num_tree_pages - len(duplicates)
        self.pool.free(duplicates)
        request.pages[:num_full] = result.pages
        self.cache.lock(result.node)
        self.cache.unlock(request.node)
        request.node = result.node
        request.num_tree_pages = num_full
        for index, page in enumerate(result.pages):
            prefix = tuple(tokens[: (index + 1) * self.page_size])
            assert self.cached.setdefault(prefix, page) == page
        assert result.node.lock_ref >= 1

    def release(self, request: Request) -> None:
        self.cache.unlock(request.node)
        self.pool.free(request.owned)
        self.requests.remove(request)

    # -- rules --

    @rule(tokens=TOKENS)
    def start_request(self, tokens: list[int]) -> None:
        # Leave the last token uncached, as the engine does: it must run through the model for logits.
        match = self.cache.match_prefix(tokens[:-1])
        assert match.pages == self.expected_match(tokens[:-1])
        assert match.num_tokens == len(match.pages) * self.page_size
        for index, page in enumerate(match.pages):
            assert self.content[page] == tuple(tokens[: (index + 1) * self.page_size])
        self.cache.lock(match.node)
        self.requests.append(Request(list(tokens), match.node, list(match.pages), match.num_tokens))

    @rule(tokens=TOKENS)
    def peek(self, tokens: list[int]) -> None:
        """A lookup without a lock (the scheduler re-matching a waiting request); it may split nodes."""
        match = self.cache.match_prefix(tokens)
        assert match.pages == self.expected_match(tokens)
        assert match.node is self.cache.root or len(match.node.pages) > 0

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 63), num_tokens=st.integers(1, 12), generate=st.integers(0, 3))
    def compute(self, which: int, num_tokens: int, generate: int) -> None:
        """Run a chunk: decode tokens appended first when the prompt is done, pages allocated on demand."""
        request = self.requests[which % len(self.requests)]
        if request.computed == len(request.tokens):
            request.tokens.append(generate)
        num_tokens = min(num_tokens, len(request.tokens) - request.computed)
        end = request.computed + num_tokens
        needed = -(-end // self.page_size) - len(request.pages)
        if needed > 0:
            available = self.pool.num_free + self.cache.evictable_pages
            reached = self.cache.ensure_free(needed)
            self.forget_evicted()
            assert reached == (available >= needed)
            if not reached:
                return  # the scheduler would leave it waiting (or preempt); nothing changed but LRU
            request.pages.extend(self.pool.allocate(needed))
        for index in range(request.computed // self.page_size, end // self.page_size):
            self.content[request.pages[index]] = tuple(request.tokens[: (index + 1) * self.page_size])
        request.computed = end

    @rule(tokens=TOKENS)
    def serve_whole_request(self, tokens: list[int]) -> None:
        """Admit, prefill in one go and finish: the quickest way to fill the tree."""
        self.start_request(tokens)
        request = self.requests[-1]
        self.compute(len(self.requests) - 1, len(tokens), 0)
        if request.computed == len(tokens):
            self.finish(len(self.requests) - 1)

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 63))
    def cache_pages(self, which: int) -> None:
        self.cache_request(self.requests[which % len(self.requests)])

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 63))
    def finish(self, which: int) -> None:
        request = self.requests[which % len(self.requests)]
        self.cache_request(request)
        self.release(request)

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 63))
    def abort(self, which: int) -> None:
        self.release(self.requests[which % len(self.requests)])

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        free_before, cached_before = self.pool.num_free, self.cache.cached_pages
        evictable, locked = self.cache.evictable_pages, self.cache.locked_pages
        freed = self.cache.evict(num_pages)
        self.forget_evicted()
        assert freed >= min(num_pages, evictable) and freed <= evictable
        assert self.pool.num_free == free_before + freed
        assert self.cache.cached_pages == cached_before - freed
        assert self.cache.locked_pages == locked

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.cached = {}
        assert self.pool.num_free == self.pool.num_pages

    # -- invariants --

    @invariant()
    def pages_are_conserved(self) -> None:
        self.cache.check_integrity(owned=[request.owned for request in self.requests])

    @invariant()
    def oracle_agrees_with_tree(self) -> None:
        assert len(self.cached) == self.cache.cached_pages
        for prefix, page in self.cached.items():
            assert self.content[page] == prefix
            assert len(prefix) == self.page_size or prefix[: -self.page_size] in self.cached

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for request in list(self.requests):
            self.release(request)
        assert self.cache.locked_pages == 0
        assert self.pool.num_free + self.cache.cached_pages == self.pool.num_pages
        self.cache.check_integrity()


RadixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRadixCacheMachine = RadixCacheMachine.TestCase
