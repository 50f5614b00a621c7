"""Content-defined chunking: the numpy path equals the per-byte reference, chunks reassemble exactly,
sizes stay in bounds, and an edit changes only the chunks around it."""

from __future__ import annotations

import hashlib
import random
from itertools import pairwise

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import chunking
from shared.chunking import (
    MAX_SIZE,
    MIN_SIZE,
    NORMAL_SIZE,
    chunk_boundaries,
    digest,
    reference_boundaries,
    split,
)

# Words of 1-, 2-, 3- and 4-byte UTF-8 characters, so texts have cuts inside multi-byte characters.
_ALPHABET = "abcdefghijklmnopqrstuvwxyz" * 4 + "éüß" + "中文字" + "😀"
_VOCAB_RNG = random.Random(0)
_VOCAB = ["".join(_VOCAB_RNG.choices(_ALPHABET, k=_VOCAB_RNG.randint(1, 10))) for _ in range(4000)] + [
    "\n",
    "\n\n",
    ",",
    ".",
]


def words(seed: int, size: int) -> bytes:
    """About `size` bytes of word-like UTF-8 text, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choices(_VOCAB, k=size // 5 + 1)).encode()[:size]


def chunk_sizes(data: bytes) -> list[int]:
    return [b - a for a, b in pairwise([0, *chunk_boundaries(data)])]


# -- the fast path equals the reference ---------------------------------------------------------

EDGE_SIZES = [0, 1, MIN_SIZE - 1, MIN_SIZE, MIN_SIZE + 1, MAX_SIZE - 1, MAX_SIZE, MAX_SIZE + 1, 70_000]


@pytest.mark.parametrize("size", EDGE_SIZES)
def test_boundaries_equal_reference_on_text_random_and_constant_bytes(size: int) -> None:
    for data in (words(size, size), random.Random(size).randbytes(size), b"\0" * size, b"ab" * (size // 2)):
        assert chunk_boundaries(data) == reference_boundaries(data)


# Seeds whose random bytes (20 KB) hold a chunk of exactly this size, found by search: the cut
# rule changes at MIN_SIZE, NORMAL_SIZE and MAX_SIZE, and off-by-ones hide there.
THRESHOLD_SEEDS = {
    MIN_SIZE: 33, MIN_SIZE + 1: 49, NORMAL_SIZE - 1: 592, NORMAL_SIZE: 58, NORMAL_SIZE + 1: 28
}  # fmt: skip


@pytest.mark.parametrize("size", [*THRESHOLD_SEEDS, MAX_SIZE])
def test_boundaries_equal_reference_where_chunks_end_exactly_at_the_size_thresholds(size: int) -> None:
    data = random.Random(THRESHOLD_SEEDS[size]).randbytes(20_000) if size != MAX_SIZE else b"\0" * 20_000
    expected = reference_boundaries(data)
    assert size in [b - a for a, b in pairwise([0, *expected])]  # the case is still covered
    assert chunk_boundaries(data) == expected


def test_boundaries_equal_reference_across_numpy_block_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    # Production blocks are 1 MiB; small ones put many seams (and their warm-up bytes) in 70 KB.
    data = words(7, 70_000)
    expected = reference_boundaries(data)
    for block in (64, 1000, 4096):
        monkeypatch.setattr(chunking, "_BLOCK", block)
        assert chunk_boundaries(data) == expected


@given(st.binary(max_size=20_000))
@settings(max_examples=60, deadline=None)
def test_boundaries_equal_reference_on_any_bytes(data: bytes) -> None:
    assert chunk_boundaries(data) == reference_boundaries(data)


@given(seed=st.integers(0, 2**32), size=st.integers(0, 40_000), text=st.booleans())
@settings(max_examples=40, deadline=None)
def test_boundaries_equal_reference_on_long_texts_and_random_bytes(seed: int, size: int, text: bool) -> None:
    # st.binary() draws mostly short values; this covers inputs of many chunks.
    data = words(seed, size) if text else random.Random(seed).randbytes(size)
    assert chunk_boundaries(data) == reference_boundaries(data)


# -- reassembly -----------------------------------------------------------------------------------


@given(st.binary(max_size=40_000))
@settings(max_examples=60, deadline=None)
def test_chunks_concatenate_to_any_bytes(data: bytes) -> None:
    chunks = split(data)
    assert b"".join(chunks) == data
    assert all(chunks)


@given(st.text(st.characters(codec="utf-8"), min_size=300, max_size=6000))
@settings(max_examples=40, deadline=None)
def test_chunks_concatenate_to_utf8_text(text: str) -> None:
    data = text.encode()
    assert b"".join(split(data)).decode() == text


def test_cuts_fall_inside_multibyte_characters_and_reassembly_still_decodes() -> None:
    text = ("中文字符" * 20_000)[:25_000]  # 3 bytes per character
    data = text.encode()
    cuts = chunk_boundaries(data)[:-1]
    assert any(data[c] & 0xC0 == 0x80 for c in cuts)  # a continuation byte starts some chunk
    assert b"".join(split(data)).decode() == text


def test_empty_input_has_no_chunks_and_short_input_one() -> None:
    assert split(b"") == []
    assert chunk_boundaries(b"") == []
    assert split(b"x" * MIN_SIZE) == [b"x" * MIN_SIZE]


# -- sizes and determinism ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [words(1, 200_000), random.Random(2).randbytes(200_000), b"\0" * 100_000],
    ids=["text", "random", "zeros"],
)
def test_chunk_sizes_are_within_min_and_max_except_the_last(data: bytes) -> None:
    sizes = chunk_sizes(data)
    assert all(MIN_SIZE <= s <= MAX_SIZE for s in sizes[:-1])
    assert 0 < sizes[-1] <= MAX_SIZE


def test_mean_chunk_is_about_one_and_a_half_kib() -> None:
    for data in (words(3, 1_000_000), random.Random(4).randbytes(1_000_000)):
        sizes = chunk_sizes(data)[:-1]
        assert 1300 <= sum(sizes) / len(sizes) <= 1800


def test_chunking_is_deterministic_and_pinned() -> None:
    # Pinned so that a change to the gear table, masks or sizes is seen: agents and gateways of
    # different versions would still reassemble correctly, but would stop sharing chunks.
    data = b"".join(hashlib.blake2b(i.to_bytes(4, "big")).digest() for i in range(400))
    assert chunk_boundaries(data) == chunk_boundaries(bytes(data))
    assert chunk_boundaries(data) == [
        1675, 3861, 5113, 7005, 7540, 8760, 10227, 11697,
        13516, 14845, 16384, 18928, 20311, 22368, 24624, 25600,
    ]  # fmt: skip
    assert chunking.GEAR[:2] == (10785742257600217101, 17360752713783767396)
    assert (chunking.STRICT_MASK, chunking.LOOSE_MASK) == (0x8888888888880000, 0x8888888880000000)


def test_digest_is_blake2b_256() -> None:
    assert digest(b"abc") == hashlib.blake2b(b"abc", digest_size=32).digest()
    assert len(digest(b"")) == 32


# -- edit locality --------------------------------------------------------------------------------


def edit(data: bytes, at: int, kind: str, patch: bytes) -> bytes:
    if kind == "insert":
        return data[:at] + patch + data[at:]
    if kind == "delete":
        return data[:at] + data[at + len(patch) :]
    return data[:at] + patch + data[at + len(patch) :]


@given(
    seed=st.integers(0, 2**32),
    size=st.integers(48_000, 96_000),
    where=st.floats(0.25, 0.75),
    kind=st.sampled_from(["insert", "delete", "replace"]),
    patch=st.binary(min_size=1, max_size=16),
)
@settings(max_examples=60, deadline=None)
def test_an_edit_in_the_middle_changes_only_nearby_chunks(
    seed: int, size: int, where: float, kind: str, patch: bytes
) -> None:
    data = words(seed, size)
    at = int(size * where)
    edited = edit(data, at, kind, patch)
    before, after = split(data), split(edited)

    # Exact: a cut depends only on bytes before it, so every chunk ending before the edit is kept.
    ends = chunk_boundaries(data)
    kept_prefix = sum(1 for e in ends if e <= at)
    assert after[:kept_prefix] == before[:kept_prefix]

    # Statistical, with a bound that random texts exceed with odds ~1e-7: the cuts resynchronise
    # within a few chunks (typically one chunk changes; see the aggregate test below).
    old = set(before)
    changed = sum(1 for c in after if c not in old)
    assert changed <= len(after) // 2


def test_edits_typically_change_one_or_two_chunks() -> None:
    rng = random.Random(11)
    changed_counts = []
    for trial in range(300):
        data = words(trial, 60_000)
        at = rng.randint(15_000, 45_000)
        kind = rng.choice(["insert", "delete", "replace"])
        edited = edit(data, at, kind, rng.randbytes(rng.randint(1, 16)))
        old = set(split(data))
        changed_counts.append(sum(1 for c in split(edited) if c not in old))
    assert sum(changed_counts) / len(changed_counts) <= 1.5
    assert sum(1 for n in changed_counts if n <= 3) >= 0.95 * len(changed_counts)


# -- cost -----------------------------------------------------------------------------------------
# What keeps chunking cheap, held as counts. Its speed is a timing: the edge bench measures it.


def test_every_byte_is_hashed_once_in_numpy_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    data = words(9, 70_000)  # ~16K tokens of English-like text
    expected = chunk_boundaries(data)
    real = chunking._window_hashes
    hashed: list[int] = []

    def counting(block: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
        hashed.append(len(block))
        return real(block)

    monkeypatch.setattr(chunking, "_window_hashes", counting)
    assert chunk_boundaries(data) == expected
    assert hashed == [len(data)]  # one numpy pass over a document below the 1 MiB block size

    hashed.clear()
    monkeypatch.setattr(chunking, "_BLOCK", 4096)
    assert chunk_boundaries(data) == expected
    seams = len(hashed) - 1
    assert len(hashed) == -(-len(data) // 4096)  # one pass per block
    assert sum(hashed) == len(data) + seams * (chunking._WINDOW - 1)  # plus one window re-hashed per seam


def test_python_steps_once_per_chunk_not_per_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    real = chunking._next_cut
    steps = 0

    def counting(start: int, strict: list[int], loose: list[int]) -> int:
        nonlocal steps
        steps += 1
        return real(start, strict, loose)

    monkeypatch.setattr(chunking, "_next_cut", counting)
    for data in (words(9, 70_000), random.Random(9).randbytes(70_000), b"\0" * 70_000):
        steps = 0
        cuts = chunk_boundaries(data)
        # the last chunk is either cut by a step past the end or left short of MIN_SIZE unstepped
        assert len(cuts) - 1 <= steps <= len(cuts)
        assert steps <= len(data) // MIN_SIZE
