"""Content-defined chunking: where to cut a long string so that an edit moves only nearby cuts.

FastCDC-style (Xia et al., 2016). A gear hash rolls over the bytes; a byte position ends a chunk
when the hash has zeros under a mask, so cut points are chosen by the content around them and an
insertion or deletion shifts the text without moving the cuts further along. Normalised chunking
uses a stricter mask (more bits, rarer cuts) while a chunk is shorter than NORMAL_SIZE and a looser
one after it, which pulls chunk sizes toward the middle; MIN_SIZE and MAX_SIZE bound them.

Invariants:
- `split(data)` concatenates back to `data` exactly; no chunk is empty; every chunk but the last has
  MIN_SIZE..MAX_SIZE bytes. Chunks are raw bytes, so a cut may fall inside a UTF-8 sequence.
- The hash is never reset: the hash at byte i depends only on bytes i-63..i (each step shifts the
  older bytes one bit left, out of the 64-bit word after 64 steps). Whether i ends a chunk depends
  on that hash and on where the current chunk started, nothing else.

`chunk_boundaries` finds every candidate position with numpy and then walks the candidates in
Python; `reference_boundaries` is the same rule as a plain per-byte loop, kept as the definition
the fast path is tested against (tests/shared/test_chunking.py).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from shared.edge_protocol import DIGEST_BYTES

MIN_SIZE = 512  # bytes; no cut is considered before a chunk has this many
NORMAL_SIZE = 1152  # bytes; from here on the looser mask applies
MAX_SIZE = 8192  # bytes; a chunk that reaches this is cut whatever the hash says
STRICT_BITS = 12  # mask bits before NORMAL_SIZE: a cut every 4096 positions on average
LOOSE_BITS = 9  # mask bits from NORMAL_SIZE on: a cut every 512 positions on average
# With these figures, text and random bytes give a mean chunk of ~1.5 KiB (measured in the tests):
# ~14% of chunks cut in MIN_SIZE..NORMAL_SIZE, the rest ~512 bytes past NORMAL_SIZE.

_WINDOW = 64  # bytes that the hash at one position depends on (one per bit of the hash)
_BLOCK = 1 << 20  # bytes hashed per numpy pass, so temporaries stay ~8 MiB for any input
_U64 = (1 << 64) - 1


def _gear_table() -> tuple[int, ...]:
    # 256 fixed pseudo-random 64-bit words; derived from BLAKE2b so that every edge agent and
    # gateway, whatever its version, cuts the same text at the same places.
    return tuple(
        int.from_bytes(hashlib.blake2b(bytes([i]), digest_size=8, person=b"ctxfuse-gear").digest(), "little")
        for i in range(256)
    )


def _spread_mask(bits: int) -> int:
    # Mask bits spread over the top of the word (63, 59, 55, ...): bit k of the hash depends on the
    # last k + 1 bytes only, so high bits make a cut depend on the whole 64-byte window.
    return sum(1 << (63 - 4 * k) for k in range(bits))


GEAR = _gear_table()
STRICT_MASK = _spread_mask(STRICT_BITS)
LOOSE_MASK = _spread_mask(LOOSE_BITS)

_GEAR_ARRAY = np.array(GEAR, dtype=np.uint64)
_STRICT_U64 = np.uint64(STRICT_MASK)
_LOOSE_U64 = np.uint64(LOOSE_MASK)


def digest(chunk: bytes) -> bytes:
    """The chunk's name on the edge link: BLAKE2b-256 of its bytes."""
    return hashlib.blake2b(chunk, digest_size=DIGEST_BYTES).digest()


def split(data: bytes) -> list[bytes]:
    """`data` cut into content-defined chunks; `b"".join(split(data)) == data`."""
    return [data[a:b] for a, b in pairwise([0, *chunk_boundaries(data)])]


def chunk_boundaries(data: bytes) -> list[int]:
    """End offsets of the chunks of `data`, ascending; the last is len(data) (none for b"")."""
    n = len(data)
    if n <= MIN_SIZE:
        return [n] if n else []
    strict, loose = _candidates(data)
    cuts: list[int] = []
    start = 0
    # A cut before the end needs a position i with i + 1 - start >= MIN_SIZE and i + 1 < n.
    while start + MIN_SIZE < n:
        end = _next_cut(start, strict, loose)
        if end >= n:
            break
        cuts.append(end)
        start = end
    cuts.append(n)
    return cuts


def _next_cut(start: int, strict: list[int], loose: list[int]) -> int:
    """End offset of the chunk starting at `start` (may be past the data: then the data ends it)."""
    # Position i ends a chunk of i + 1 - start bytes.
    first = start + MIN_SIZE - 1
    normal = start + NORMAL_SIZE - 1
    last = start + MAX_SIZE - 1
    i = _first_in(strict, first, normal)
    if i is None:
        i = _first_in(loose, normal, last)
    return (last if i is None else i) + 1


def _first_in(positions: list[int], lo: int, hi: int) -> int | None:
    """The smallest of the sorted `positions` in [lo, hi), or None."""
    k = bisect_left(positions, lo)
    if k < len(positions) and positions[k] < hi:
        return positions[k]
    return None


def _candidates(data: bytes) -> tuple[list[int], list[int]]:
    """Positions whose hash has zeros under the strict mask, and under the loose mask."""
    arr = np.frombuffer(data, dtype=np.uint8)
    strict: list[int] = []
    loose: list[int] = []
    for lo in range(0, len(arr), _BLOCK):
        # Re-hash the window's worth of bytes before the block so its first hashes are complete.
        warm = min(lo, _WINDOW - 1)
        hashes = _window_hashes(arr[lo - warm : lo + _BLOCK])[warm:]
        strict.extend((np.flatnonzero((hashes & _STRICT_U64) == 0) + lo).tolist())
        loose.extend((np.flatnonzero((hashes & _LOOSE_U64) == 0) + lo).tolist())
    return strict, loose


def _window_hashes(block: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """hashes[i] = sum(GEAR[block[i - j]] << j for j in 0..63 with i - j >= 0), mod 2**64.

    That is the rolling hash `h = (h << 1) + GEAR[byte]` at every position, computed by doubling:
    with h_w the sum over the last w bytes, h_2w[i] = h_w[i] + (h_w[i - w] << w), so six vectorised
    passes replace a Python step per byte. uint64 arithmetic wraps, as the mod 2**64 requires.
    """
    hashes = _GEAR_ARRAY[block]  # [n] uint64
    width = 1
    while width < _WINDOW:
        # The right side is computed into a new array before the in-place add, so no overlap.
        hashes[width:] += hashes[:-width] << np.uint64(width)
        width *= 2
    return hashes


def reference_boundaries(data: bytes) -> list[int]:
    """The chunking rule as a per-byte loop: the definition `chunk_boundaries` must equal.

    About 20x slower than `chunk_boundaries` (~9 ms against ~0.45 ms for 70 KB), so only tests use it.
    """
    cuts: list[int] = []
    start = 0
    h = 0
    for i, byte in enumerate(data):
        h = ((h << 1) + GEAR[byte]) & _U64
        size = i + 1 - start
        if size < MIN_SIZE:
            continue
        mask = STRICT_MASK if size < NORMAL_SIZE else LOOSE_MASK
        if size >= MAX_SIZE or h & mask == 0:
            cuts.append(i + 1)
            start = i + 1
    if start < len(data):
        cuts.append(len(data))
    return cuts
