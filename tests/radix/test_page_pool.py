"""PagePool: allocation, freeing, and refusal of misuse without partial changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mili_openai.radix import OutOfPages, PagePool


def test_fresh_pool_hands_out_distinct_ids_in_range() -> None:
    pool = PagePool(5)
    pages = pool.allocate(3)
    assert pages == [0, 1, 2]
    assert pool.num_free == 2 and pool.num_pages - pool.num_free == 3
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 0


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1
    assert len(pool.allocate(1)) == 1


def test_allocate_zero_and_negative() -> None:
    pool = PagePool(2)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free == 2


def test_free_returns_pages_for_reuse() -> None:
    pool = PagePool(3)
    pages = pool.allocate(3)
    pool.free([pages[1]])
    assert pool.is_free(pages[1]) and not pool.is_free(pages[0])
    assert pool.allocate(1) == [pages[1]]


def test_double_free_raises_and_frees_nothing() -> None:
    pool = PagePool(4)
    first, second = pool.allocate(2)
    pool.free([first])
    with pytest.raises(ValueError, match="double free"):
        pool.free([second, first])
    assert not pool.is_free(second)  # the valid page in the failed call was not freed either
    assert pool.num_free == 3


def test_same_page_twice_in_one_call_is_a_double_free() -> None:
    pool = PagePool(4)
    (page,) = pool.allocate(1)
    with pytest.raises(ValueError, match="twice"):
        pool.free([page, page])
    assert pool.num_free == 3


@pytest.mark.parametrize("bad", [-1, 4, 100, "1", 1.0, True])
def test_unknown_page_id_raises(bad: object) -> None:
    pool = PagePool(4)
    pool.allocate(4)
    with pytest.raises(ValueError, match="unknown page"):
        pool.free([bad])
    assert pool.num_free == 0


@pytest.mark.parametrize("bad", [0, -3, 2.0, "8", True])
def test_pool_size_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError):
        PagePool(bad)


def test_check_integrity_catches_a_corrupted_free_list() -> None:
    pool = PagePool(4)
    pool.check_integrity()
    pool._free_stack.append(pool._free_stack[0])  # simulate a bookkeeping bug
    with pytest.raises(RuntimeError, match="disagree"):
        pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(1, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_random_allocate_free_conserves_pages(num_pages: int, ops: list[tuple[bool, int]]) -> None:
    pool = PagePool(num_pages)
    held: list[int] = []
    for is_allocate, amount in ops:
        if is_allocate:
            if amount > pool.num_free:
                with pytest.raises(OutOfPages):
                    pool.allocate(amount)
            else:
                held.extend(pool.allocate(amount))
        else:
            released, held = held[:amount], held[amount:]
            pool.free(released)
        pool.check_integrity()
        assert len(set(held)) == len(held)
        assert not any(pool.is_free(page) for page in held)
        assert pool.num_free + len(held) == num_pages
