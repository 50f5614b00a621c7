"""Text-chunk keys of a chat, a conversation's next turn hashing only what its earlier turn did not.

A chat's prompt text is its messages' pieces (`role: text`, keys.py) joined by newlines, keyed in
chained chunks of TEXT_CHUNK_CHARS (text_chunk_keys). Hashing it whole costs ~0.2 ms at 16,000
tokens (encoding and blake2b over 70 KB) and grows with every turn. So the memo keeps, per chat it
has keyed, where the hashing stood after its last message: the hash state, the chunk keys so far and
the chars not yet in a whole chunk. The next turn repeats those messages and adds some: it finds the
longest run of its leading messages remembered, goes on from there, and is remembered in turn.

A run of messages is found by its pieces' string hashes (Python's, keyed per process, computed at C
speed: ~17 us for 70 KB) chained with the tenant's key and checked against the run's length in
chars, so tenants never share a remembered run; a collision (the same 64-bit hash and length) could
only misroute, never leak or fail a request. What comes out equals hashing the joined text whole
(text_chunk_keys), which the tests hold it to.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

TEXT_CHUNK_CHARS = 1024
# Remembered chats, least recently used dropped first; each holds a hash state, its keys (a 16-byte
# bytes, ~57 bytes with Python's overhead, per 1,024 chars) and under 1,024 chars: ~15 KB for a
# 64,000-token chat, ~2 KB at 2,000; so at most ~30 MB if every chat remembered is that long.
MEMO_CHATS = 2048


def text_chunk_keys(text: str) -> list[bytes]:
    """Chained keys of `text`'s whole chunks: a chunk's key names all the text before its end."""
    return _Hashing(hashlib.blake2b(digest_size=16), "", []).feed(text).keys


@dataclass(slots=True)
class _Hashing:
    state: Any  # hashlib's blake2b over every whole chunk so far (typeshed has no public name for it)
    pending: str  # the chars after the last whole chunk
    keys: list[bytes]

    def feed(self, text: str) -> _Hashing:
        pending = self.pending + text
        whole = len(pending) // TEXT_CHUNK_CHARS
        for i in range(whole):
            chunk = pending[i * TEXT_CHUNK_CHARS : (i + 1) * TEXT_CHUNK_CHARS]
            self.state.update(chunk.encode("utf-8", "replace"))
            self.keys.append(self.state.copy().digest())
        self.pending = pending[whole * TEXT_CHUNK_CHARS :]
        return self

    def copy(self) -> _Hashing:
        return _Hashing(self.state.copy(), self.pending, list(self.keys))


@dataclass(frozen=True, slots=True)
class _Remembered:
    chars: int  # the joined text's length up to the end of the run's last piece
    hashing: _Hashing  # never fed again: a turn that goes on from it feeds a copy


class TextMemo:
    """Chat text-chunk keys by run of leading messages. Thread-safe: the router keys some requests
    on worker threads."""

    def __init__(self, max_chats: int = MEMO_CHATS) -> None:
        self.max_chats = max_chats
        self._runs: OrderedDict[int, _Remembered] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    def keys(self, pieces: tuple[str, ...], extra_key: bytes) -> list[bytes]:
        """The keys of "\\n".join(pieces), from the longest remembered run of its leading pieces in
        `extra_key`'s partition; the whole is remembered after."""
        if not pieces:
            return []
        runs, ends, run, chars = [], [], hash(extra_key), -1
        for piece in pieces:
            run = hash((run, piece))
            chars += len(piece) + 1  # the newline before it, but for the first
            runs.append(run)
            ends.append(chars)
        start, hashing = 0, None
        with self._lock:
            for i in range(len(pieces) - 1, -1, -1):
                found = self._runs.get(runs[i])
                if found is not None and found.chars == ends[i]:
                    start, hashing = i + 1, found.hashing.copy()
                    break
        if hashing is None:
            hashing = _Hashing(hashlib.blake2b(digest_size=16), "", [])
        for i in range(start, len(pieces)):
            hashing.feed(pieces[i] if i == 0 else "\n" + pieces[i])
        with self._lock:
            self._runs[runs[-1]] = _Remembered(ends[-1], hashing.copy())
            self._runs.move_to_end(runs[-1])
            while len(self._runs) > self.max_chats:
                self._runs.popitem(last=False)
        return hashing.keys
