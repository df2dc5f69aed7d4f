"""StateCache's slot moves on a CPU pool (one slice per slot: torch's index ops along the slot dim are slow there)
give what the index ops give: the reference is the same cache with them (`_by_slot` off)."""

from __future__ import annotations

import copy

import pytest
import torch

from mili_openai.model.cache_spec import PagedKVSpec, RecurrentStateSpec
from mili_openai.model.state_cache import StateCache

SPECS = [RecurrentStateSpec((8, 3), (2, 4, 4)), PagedKVSpec(1, 8), RecurrentStateSpec((8, 3), (2, 4, 4))]
SLOTS = 6


def filled_pair() -> tuple[StateCache, StateCache]:
    """(a cache moving slot by slot, the same contents moving through torch's index ops)."""
    cache = StateCache(SPECS, SLOTS, torch.bfloat16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=generator))
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=generator))
    reference = copy.deepcopy(cache)
    reference._by_slot = False
    assert cache._by_slot
    return cache, reference


def assert_same(cache: StateCache, reference: StateCache) -> None:
    assert torch.equal(cache.conv, reference.conv) and torch.equal(cache.recurrent, reference.recurrent)


@pytest.mark.parametrize("src, dst", [([0, 1], [4, 5]),  # disjoint: slice copies
                                      ([0, 1], [1, 2]),  # 1 is read and written: gathered first
                                      ([3], [0]), ([], [])])
def test_copy(src, dst):
    cache, reference = filled_pair()
    for each in (cache, reference):
        each.copy(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
    assert_same(cache, reference)
    if src:
        assert torch.equal(cache.recurrent[:, dst[-1]], reference.recurrent[:, dst[-1]])


def test_reset_save_restore_and_kept():
    cache, reference = filled_pair()
    slots = torch.tensor([1, 4])
    saved = [each.save(slots) for each in (cache, reference)]
    assert all(torch.equal(a, b) for a, b in zip(*saved))
    for each in (cache, reference):
        each.reset(slots)
    assert_same(cache, reference)
    assert not cache.recurrent[:, 4].any() and cache.recurrent[:, 3].any()
    for each, states in zip((cache, reference), saved):
        each.restore(slots, states)
        each.keep_verified_states(3)
        each.kept_conv.copy_(each.conv[:, :3])
        each.kept_recurrent.copy_(each.recurrent[:, 2:5])
        each.restore_kept(torch.tensor([2, 0]), torch.tensor([5, 1]))
    assert_same(cache, reference)
    assert torch.equal(cache.recurrent[:, 5], cache.recurrent[:, 4])  # kept row 2 was slot 4's state
