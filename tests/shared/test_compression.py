"""zstd frames on the edge link: round trips, and a decompressor that refuses bombs, lying headers,
garbage, truncation and trailing bytes without allocating past its cap."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.compression import ChunkError, compress, decompress
from shared.errors import InvalidRequestError

CAP = 8192
BOMB_BYTES = 100_000_000  # zeros: ~3 KB compressed
_PEAK_LIMIT = 2_000_000  # bytes a refused frame may make Python allocate (tracemalloc)


def _bomb(*, with_size: bool) -> bytes:
    # Compressed 1 MB at a time, so building it does not hold 100 MB either.
    cobj = zstandard.ZstdCompressor(level=3).compressobj(size=BOMB_BYTES if with_size else -1)
    zeros = bytes(1_000_000)
    body = b"".join(cobj.compress(zeros) for _ in range(BOMB_BYTES // len(zeros)))
    return body + cobj.flush()


@pytest.fixture(scope="module")
def bomb_with_size() -> bytes:
    return _bomb(with_size=True)


@pytest.fixture(scope="module")
def bomb_without_size() -> bytes:
    return _bomb(with_size=False)


def claim_size(frame: bytes, claimed: int) -> bytes:
    """`frame` (written without a content size) with a header that says it holds `claimed` bytes."""
    descriptor = frame[4]
    if descriptor & 0xE3:  # content-size flag, single-segment flag or a dictionary id present
        raise ValueError("claim_size needs a frame with a window descriptor and nothing else")
    # Content-size flag 2: a 4-byte little-endian size after the window descriptor (RFC 8878 3.1.1.1).
    return frame[:4] + bytes([descriptor | 0x80]) + frame[5:6] + claimed.to_bytes(4, "little") + frame[6:]


@pytest.fixture
def peak_bytes() -> Iterator[Callable[[], int]]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    yield lambda: tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1536, CAP])
def test_compress_then_decompress_returns_the_chunk(size: int) -> None:
    chunk = os.urandom(size // 2) + b"a" * (size - size // 2)
    frame = compress(chunk)
    assert zstandard.get_frame_parameters(frame).content_size == size  # size in the header
    assert decompress(frame, CAP) == chunk


@given(st.binary(max_size=CAP))
@settings(max_examples=100, deadline=None)
def test_round_trip_of_any_bytes(chunk: bytes) -> None:
    assert decompress(compress(chunk), CAP) == chunk


def test_frames_from_other_zstd_writers_with_checksums_are_accepted() -> None:
    writer = zstandard.ZstdCompressor(level=19, write_checksum=True)
    for chunk in (b"", b"hello " * 300):
        assert decompress(writer.compress(chunk), CAP) == chunk


def test_text_compresses() -> None:
    chunk = b"the quick brown fox jumps over the lazy dog. " * 40
    assert len(compress(chunk)) < len(chunk) // 4


# -- caps -----------------------------------------------------------------------------------------


def test_a_chunk_of_exactly_max_size_is_accepted_and_one_more_byte_refused() -> None:
    assert decompress(compress(b"x" * CAP), CAP) == b"x" * CAP
    with pytest.raises(ChunkError, match="more than the 8192 allowed"):
        decompress(compress(b"x" * (CAP + 1)), CAP)


def test_a_bomb_is_refused_from_its_header_without_allocating(
    bomb_with_size: bytes, peak_bytes: Callable[[], int]
) -> None:
    assert len(bomb_with_size) < 100_000
    assert zstandard.get_frame_parameters(bomb_with_size).content_size == BOMB_BYTES
    with pytest.raises(ChunkError, match="more than"):
        decompress(bomb_with_size, CAP)
    assert peak_bytes() < _PEAK_LIMIT


def test_a_bomb_without_a_content_size_is_refused(
    bomb_without_size: bytes, peak_bytes: Callable[[], int]
) -> None:
    with pytest.raises(ChunkError, match="does not state its content size"):
        decompress(bomb_without_size, CAP)
    assert peak_bytes() < _PEAK_LIMIT


@pytest.mark.parametrize("claimed", [1, 1000, CAP])
def test_a_bomb_whose_header_claims_a_small_size_is_refused_without_allocating(
    bomb_without_size: bytes, claimed: int, peak_bytes: Callable[[], int]
) -> None:
    lying = claim_size(bomb_without_size, claimed)
    assert zstandard.get_frame_parameters(lying).content_size == claimed
    with pytest.raises(ChunkError, match="bad zstd frame"):
        decompress(lying, CAP)
    assert peak_bytes() < _PEAK_LIMIT


@pytest.mark.parametrize("claimed", [0, 299, 301, 5000])
def test_a_header_that_misstates_a_small_chunk_is_refused(claimed: int) -> None:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"a" * 300)
    assert decompress(claim_size(frame, 300), CAP) == b"a" * 300  # the helper itself is sound
    with pytest.raises(ChunkError):
        decompress(claim_size(frame, claimed), CAP)


def test_a_truncated_lying_frame_cannot_ask_for_a_large_window(bomb_without_size: bytes) -> None:
    # Truncated, the frame takes zstd's streaming path, which would allocate the window the frame
    # asks for (2 MiB here; up to 128 MiB by default); the decoder's window is capped near CAP.
    lying = claim_size(bomb_without_size, 1000)[:-5]
    assert zstandard.get_frame_parameters(lying).window_size > 2 * CAP
    with pytest.raises(ChunkError, match="too much memory"):
        decompress(lying, CAP)


# -- malformed frames -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x28", b"garbage!", zstandard.MAGIC_NUMBER.to_bytes(4, "little"), os.urandom(64)],
    ids=["empty", "one-byte", "text", "magic-only", "random"],
)
def test_garbage_is_refused(garbage: bytes) -> None:
    with pytest.raises(ChunkError, match="not a zstd frame"):
        decompress(garbage, CAP)


def test_a_skippable_frame_is_refused() -> None:
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"abcd"
    with pytest.raises(ChunkError):
        decompress(skippable, CAP)


def test_every_truncation_of_a_frame_is_refused() -> None:
    frame = compress(os.urandom(1000) + b"b" * 1000)
    for end in range(len(frame)):
        with pytest.raises(ChunkError):
            decompress(frame[:end], CAP)


@pytest.mark.parametrize("chunk", [b"", b"hello " * 100], ids=["empty", "text"])
@pytest.mark.parametrize(
    "trailer", [b"\0", b"junk", compress(b"second frame")], ids=["zero-byte", "junk", "second-frame"]
)
def test_bytes_after_the_frame_are_refused(chunk: bytes, trailer: bytes) -> None:
    with pytest.raises(ChunkError):
        decompress(compress(chunk) + trailer, CAP)


def test_a_frame_claiming_to_be_empty_but_holding_blocks_is_refused() -> None:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"a" * 300)
    with pytest.raises(ChunkError, match="says it is empty"):
        decompress(claim_size(frame, 0), CAP)


def test_a_corrupted_compressed_block_is_refused() -> None:
    # (A flipped byte inside a raw block decodes "fine": the digest check in the chunk store is what
    # catches that; zstd's own checksum is not written, since the digest makes it redundant.)
    frame = bytearray(compress(b"abcdefgh" * 500))
    frame[-3] ^= 0xFF
    with pytest.raises(ChunkError, match="bad zstd frame"):
        decompress(bytes(frame), CAP)


# -- the error ------------------------------------------------------------------------------------


def test_chunk_error_is_a_value_error_and_a_400() -> None:
    with pytest.raises(ChunkError) as caught:
        decompress(b"garbage!", CAP)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, InvalidRequestError)
    assert caught.value.status == 400
    assert caught.value.to_openai()["error"]["code"] == "invalid_chunk"


def test_a_negative_cap_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="max_size"):
        decompress(compress(b"x"), -1)
