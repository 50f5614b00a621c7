"""The router's prefix index: leading-run matching per backend, an LRU bound on its size, and a
backend forgotten whole when it restarts."""

from __future__ import annotations

import pytest

from gateway.backends.fleet.index import PrefixIndex


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_matching_counts_the_leading_run_each_backend_holds() -> None:
    idx = PrefixIndex(100)
    idx.add("a", keys("k1", "k2", "k3"))
    idx.add("b", keys("k1"))
    assert idx.matched(keys("k1", "k2", "k3", "k4"), ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert idx.matched(keys("k2", "k3"), ["a"]) == {"a": 2}
    assert idx.matched(keys("x", "k1"), ["a", "b"]) == {"a": 0, "b": 0}  # a chain that starts elsewhere


def test_the_index_never_holds_more_than_its_capacity_and_drops_the_least_recent() -> None:
    idx = PrefixIndex(3)
    idx.add("a", keys("k1", "k2"))
    idx.add("b", keys("x1"))
    idx.matched(keys("k1", "k2"), ["a"])  # a's chain is now more recent than b's
    idx.add("c", keys("y1"))
    assert len(idx) == 3
    assert idx.matched(keys("x1"), ["b"]) == {"b": 0}  # x1 was the least recently used
    assert idx.matched(keys("k1", "k2"), ["a"]) == {"a": 2}
    assert idx.held_by("a") == 2 and idx.held_by("b") == 0 and idx.held_by("c") == 1
    for i in range(1000):
        idx.add("c", [f"n{i}".encode()])
    assert len(idx) == 3 and idx.held_by("a") == 0


def test_a_full_index_drops_a_chains_deepest_keys_first_so_its_prefix_still_matches() -> None:
    idx = PrefixIndex(4)
    idx.add("a", keys("k1", "k2", "k3", "k4"))
    idx.add("b", keys("x1", "x2"))  # two of a's keys must go: its deepest two
    assert idx.matched(keys("k1", "k2", "k3", "k4"), ["a"]) == {"a": 2}
    idx.add("c", keys("y1"))  # touched last, a's k1-k2 outlive b's chain, whose x2 goes first
    assert idx.matched(keys("x1", "x2"), ["b"]) == {"b": 1}
    assert idx.matched(keys("k1", "k2"), ["a"]) == {"a": 2}


def test_forgetting_a_backend_leaves_the_others() -> None:
    idx = PrefixIndex(10)
    idx.add("a", keys("k1", "k2"))
    idx.add("b", keys("k1", "k2"))
    idx.forget("a")
    assert idx.matched(keys("k1", "k2"), ["a", "b"]) == {"a": 0, "b": 2}
    assert idx.held_by("a") == 0
    idx.remove("b", keys("k2"))
    assert idx.matched(keys("k1", "k2"), ["b"]) == {"b": 1}
    idx.remove("b", keys("k1"))
    assert len(idx) == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)
