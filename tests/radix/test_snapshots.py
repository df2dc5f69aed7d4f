"""State snapshots on radix nodes (radix/snapshots.py): a hybrid model's resume points. Matching finds the longest
prefix ending at a snapshot, never K/V alone; evicting a node frees its snapshot; a snapshot can be evicted
alone (LRU) when none is free; splits keep a snapshot at the end of its path; the ids are conserved."""

from __future__ import annotations

import pytest

from mili_openai.radix import PagePool, RadixCache, SnapshotStore

PAGE = 4
FIRST_ID = 10  # snapshot ids follow the running sequences' state slots


def make_cache(num_pages: int = 16, num_snapshots: int = 3) -> RadixCache:
    return RadixCache(PAGE, PagePool(num_pages), SnapshotStore(num_snapshots, FIRST_ID))


def cache_with_snapshot(cache: RadixCache, tokens: list[int]):
    """Insert tokens as a finished request would, with a snapshot at their end; returns the node."""
    pages = cache.pool.allocate(len(tokens) // PAGE)
    result = cache.insert(tokens, pages)
    cache.pool.free(mine for mine, kept in zip(pages, result.pages) if mine != kept)
    snapshot_id = cache.snapshots.reserve()
    assert snapshot_id is not None
    cache.snapshots.attach(result.node, snapshot_id)
    return result.node


def test_match_snapshot_needs_a_snapshot_at_the_end_of_the_prefix() -> None:
    cache = make_cache()
    tokens = list(range(12))
    pages = cache.pool.allocate(3)
    cache.insert(tokens, pages)
    assert cache.match_prefix(tokens).num_tokens == 12
    assert cache.match_snapshot(tokens).num_tokens == 0  # K/V alone is never a resume point
    node = cache.insert(tokens[:8], pages[:2]).node  # splits the node at the snapshot's page boundary
    cache.snapshots.attach(node, cache.snapshots.reserve())
    match = cache.match_snapshot(tokens + [99])
    assert (match.num_tokens, match.pages, match.node.snapshot) == (8, pages[:2], FIRST_ID)
    cache.check_integrity()


def test_split_below_a_snapshot_keeps_it_at_the_end_of_its_path() -> None:
    cache = make_cache()
    node = cache_with_snapshot(cache, list(range(12)))
    cache.match_prefix(list(range(4)) + [50, 51, 52, 53])  # splits after the first page
    assert node.snapshot == FIRST_ID and len(node.key) == 8
    assert node.parent.snapshot is None
    assert cache.match_snapshot(list(range(12)) + [1]).num_tokens == 12
    cache.check_integrity()


def test_evicting_a_node_frees_its_snapshot() -> None:
    cache = make_cache(num_pages=4)
    cache_with_snapshot(cache, list(range(8)))
    assert cache.snapshots.num_attached == 1
    assert cache.ensure_free(4)
    assert cache.snapshots.num_attached == 0 and cache.snapshots.num_free == 3
    cache.check_integrity()


def test_leaves_without_a_snapshot_are_evicted_first() -> None:
    cache = make_cache(num_pages=4)
    cache_with_snapshot(cache, [1, 1, 1, 1])
    pages = cache.pool.allocate(1)
    cache.insert([2, 2, 2, 2], pages)  # newer, but no hybrid request can resume from it
    assert cache.evict(1) == 1
    assert cache.match_snapshot([1, 1, 1, 1, 0]).num_tokens == 4
    assert cache.match_prefix([2, 2, 2, 2, 0]).num_tokens == 0
    cache.check_integrity()


def test_a_full_store_evicts_the_least_recently_used_snapshot_alone() -> None:
    cache = make_cache(num_snapshots=2)
    first = cache_with_snapshot(cache, [1] * 4)
    cache_with_snapshot(cache, [2] * 4)
    cache.match_prefix([2] * 4 + [1])
    cache.match_prefix([1] * 4 + [1])  # the first is now the more recent
    cache_with_snapshot(cache, [3] * 4)
    assert first.snapshot is not None
    assert cache.match_snapshot([2] * 4 + [0]).num_tokens == 0  # its snapshot went
    assert cache.match_prefix([2] * 4 + [0]).num_tokens == 4  # its pages stayed
    assert cache.snapshots.num_evicted_alone == 1
    cache.check_integrity()


def test_a_snapshot_with_a_deeper_one_on_its_path_is_evicted_first() -> None:
    """A multi-turn conversation: its first turn's snapshot, now above its second's, goes before another
    conversation's only one, even though the match that reached the second turn touched it last."""
    cache = make_cache(num_snapshots=3)
    other = cache_with_snapshot(cache, [7] * 4)
    first_turn = cache_with_snapshot(cache, [1] * 4)
    second_turn = cache_with_snapshot(cache, [1] * 4 + [2] * 4)
    cache.match_snapshot([1] * 4 + [2] * 4 + [3])  # touches both of its path's nodes, after `other`
    held = [cache.snapshots.reserve()]
    assert first_turn.snapshot is None and other.snapshot is not None and second_turn.snapshot is not None
    held.append(cache.snapshots.reserve())  # none above another now: the least recently used goes
    assert other.snapshot is None and second_turn.snapshot is not None
    cache.check_integrity(held_snapshots=held)


def test_held_ids_count_and_a_second_snapshot_on_a_node_is_released() -> None:
    cache = make_cache(num_snapshots=2)
    node = cache_with_snapshot(cache, [5] * 8)
    held = cache.snapshots.reserve()
    cache.check_integrity(held_snapshots=[held])
    with pytest.raises(RuntimeError, match="free \\+ attached \\+ held"):
        cache.check_integrity()
    assert not cache.snapshots.attach(node, held)  # the node's own describes the same state
    assert cache.snapshots.num_free == 1
    assert cache.snapshots.reserve() is not None and cache.snapshots.reserve() is not None  # evicts the attached
    assert cache.snapshots.reserve() is None  # both held by sequences: nothing to evict


def test_reset_frees_every_snapshot() -> None:
    cache = make_cache()
    cache_with_snapshot(cache, [7] * 4)
    cache_with_snapshot(cache, [8] * 8)
    cache.reset()
    assert cache.snapshots.num_free == 3 and cache.snapshots.num_attached == 0
    cache.check_integrity()
