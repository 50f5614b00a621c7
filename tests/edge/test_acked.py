"""The agent's set of chunks the gateway acknowledged: bounded, least recently used out first, kept
across restarts, and corrected when the gateway says it lacks some."""

from __future__ import annotations

from pathlib import Path

from edge.acked import AckedChunks


def d(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_known_add_forget_and_the_lru_bound(tmp_path: Path) -> None:
    acked = AckedChunks(tmp_path / "a.sqlite", max_entries=3)
    acked.add([d(1), d(2), d(3)])
    assert acked.known([d(1), d(4)]) == {d(1)}
    acked.add([d(1)])  # 1 is used again: 2 is now the oldest
    acked.add([d(4)])
    assert acked.known([d(1), d(2), d(3), d(4)]) == {d(1), d(3), d(4)} and len(acked) == 3
    acked.forget([d(3), d(9)])
    assert acked.known([d(3)]) == set() and len(acked) == 2
    acked.add([d(5), d(6)])
    assert len(acked) == 3 and acked.known([d(1), d(4)]) == {d(4)}  # 1 was used before 4


def test_a_restart_keeps_what_was_acknowledged(tmp_path: Path) -> None:
    acked = AckedChunks(tmp_path / "a.sqlite", max_entries=10)
    acked.add([d(i) for i in range(5)])
    acked.close()
    again = AckedChunks(tmp_path / "a.sqlite", max_entries=3)
    assert len(again) == 5  # over a smaller bound until the next add
    again.add([d(9)])
    assert again.known([d(i) for i in range(10)]) == {d(3), d(4), d(9)}
