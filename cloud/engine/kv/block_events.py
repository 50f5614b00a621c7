"""The prefix cache's history for one engine: which block hashes entered it and which left it, in
order, so a router elsewhere can keep its own copy of what this engine holds.

- The block pool writes (on the engine thread): `stored` when a hash enters the pool's `cached` map,
  `evicted` when it leaves. Events follow `cached` exactly, so a hash is held here if and only if a
  lookup of it would find a block.
- HTTP threads read: `since` answers from this log's own copy (the held set and a bounded deque of
  recent events), never from the pool's dict, under one lock that each write takes once.
- A log may mirror another process's (`apply`): the engine process sends its changes with each batch,
  and the worker's HTTP side answers its router from the mirror, with the mirror's own epoch.
- Event n is the n-th write since construction. The log keeps the last `capacity` events; a reader
  whose cursor is older than that, from the future, or from another `epoch` (another process) gets a
  reset: every hash held now.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from itertools import islice

from shared.block_hash import BlockHash
from shared.fleet_protocol import BlockEvents

DEFAULT_CAPACITY = 65536  # events kept: 16-byte hashes, about 1 MiB of answer at most


class BlockEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("the block event log needs room for at least one event")
        self.capacity = capacity
        self.epoch = secrets.token_hex(8)  # a new one per engine: cursors of another one mean nothing here
        self._lock = threading.Lock()
        self._held: set[BlockHash] = set()
        self._events: deque[tuple[BlockHash, bool]] = deque(maxlen=capacity)  # (hash, stored?)
        self._next = 0  # the sequence number of the next event

    @property
    def next_event(self) -> int:
        with self._lock:
            return self._next

    def stored(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._held.add(block_hash)
            self._events.append((block_hash, True))
            self._next += 1

    def evicted(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._held.discard(block_hash)
            self._events.append((block_hash, False))
            self._next += 1

    def apply(self, changes: BlockEvents) -> None:
        """Follow another log's changes (its `since`); its reset becomes the evictions and stores
        that turn what this log holds into what that one holds."""
        with self._lock:
            if changes.reset:
                now = set(changes.stored)
                gone = [h for h in self._held if h not in now]
                new = [h for h in changes.stored if h not in self._held]
                evicted, stored = gone, new
            else:
                evicted, stored = changes.evicted, changes.stored
            for block_hash in evicted:
                self._held.discard(block_hash)
                self._events.append((block_hash, False))
            for block_hash in stored:
                self._held.add(block_hash)
                self._events.append((block_hash, True))
            self._next += len(evicted) + len(stored)

    def held(self) -> set[BlockHash]:
        """A copy of the hashes held now."""
        with self._lock:
            return set(self._held)

    def since(self, epoch: str | None, seq: int) -> BlockEvents:
        """What changed from event `seq` on, or a reset (every held hash) when this log cannot say.

        The change is net: each hash appears once, in `stored` or `evicted` after its last event, so a
        reader may apply the two lists in any order (a hash stored then evicted within the range is
        only in `evicted`)."""
        with self._lock:
            oldest = self._next - len(self._events)
            if epoch != self.epoch or not oldest <= seq <= self._next:
                return BlockEvents(
                    epoch=self.epoch, reset=True, stored=list(self._held), evicted=[], next_event=self._next
                )
            last: dict[BlockHash, bool] = {}  # newest first: the first event met per hash is its last
            for block_hash, stored in islice(reversed(self._events), self._next - seq):
                last.setdefault(block_hash, stored)
            next_event = self._next
        stored_now: list[BlockHash] = []
        evicted_now: list[BlockHash] = []
        for block_hash, stored in reversed(last.items()):  # back to the order the changes happened
            (stored_now if stored else evicted_now).append(block_hash)
        return BlockEvents(
            epoch=self.epoch, reset=False, stored=stored_now, evicted=evicted_now, next_event=next_event
        )
