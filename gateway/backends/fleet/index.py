"""What the gateway knows each backend holds: prefix keys (a ctxfuse worker's KV block hashes, or
text-chunk hashes for other servers) -> the backends holding them.

Bounded: at most `capacity` keys, least recently used dropped first, so a long-running gateway's
memory stays flat however many distinct prompts pass (unbounded router trees are a known leak).
A chain is touched from its end back to its head, so its head is the most recent of its keys and a
full index drops a prompt's deepest keys before its first ones: what stays is still a prefix that
matches (a chain whose head went would match nothing, however much of its tail were kept).
A backend that restarts or leaves is dropped whole (`forget`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the prefix index needs room for at least one key")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()
        self._keys: dict[str, set[bytes]] = {}  # backend -> its keys, to forget a backend in one go

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, backend: str, keys: Sequence[bytes]) -> None:
        """`keys`: a chain, head first."""
        mine = self._keys.setdefault(backend, set())
        for key in reversed(keys):
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = set()
            else:
                self._holders.move_to_end(key)
            holders.add(backend)
            mine.add(key)
        while len(self._holders) > self.capacity:
            key, gone = self._holders.popitem(last=False)
            for b in gone:
                self._keys[b].discard(key)

    def remove(self, backend: str, keys: Iterable[bytes]) -> None:
        mine = self._keys.get(backend)
        if mine is None:
            return
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None and backend in holders:
                holders.discard(backend)
                mine.discard(key)
                if not holders:
                    del self._holders[key]

    def forget(self, backend: str) -> None:
        for key in self._keys.pop(backend, set()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(backend)
                if not holders:
                    del self._holders[key]

    def matched(self, chain: Sequence[bytes], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many leading keys of `chain` it holds (a chained hash names its whole
        prefix, so the run stops at the first key a backend lacks). Touches the keys found."""
        alive = set(backends)
        counts = dict.fromkeys(alive, 0)
        found = 0
        for key in chain:
            holders = self._holders.get(key)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            found += 1
            for b in alive:
                counts[b] += 1
        for i in range(found - 1, -1, -1):
            self._holders.move_to_end(chain[i])
        return counts

    def held_by(self, backend: str) -> int:
        return len(self._keys.get(backend, ()))
