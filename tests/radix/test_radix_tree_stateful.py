"""RadixCache as the scheduler drives it: a stateful model of requests against pool + tree.

The machine plays the scheduler: requests match their prompt, lock, allocate private pages (evicting
when short), compute, cache their full pages, and finish or abort. An oracle remembers which token
prefix every page holds, so a match returning a page with the wrong K/V fails the test.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mili_openai.radix import PagePool, RadixCache, RadixNode


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
