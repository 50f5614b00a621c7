"""Prompt lookup: the next tokens drafted from the request's own context.

A request that quotes, extracts from or edits its document writes what its context already holds.
So the tokens that end the sequence are looked up earlier in it, and what followed them there is the
draft. Every occurrence of each `min_n`-gram is indexed as tokens arrive (the latest few per
n-gram), so a lookup costs the same at 50 tokens or 32,000. Of the occurrences of the last `min_n`
tokens, the one that agrees with the sequence's end over the most tokens (up to `max_n`) wins, the
latest on a tie: a span of the document beats the question that merely names it.
"""

from __future__ import annotations

_KEEP = 8  # occurrences kept per n-gram (the latest)


class NgramIndex:
    """The `min_n`-grams of a sequence that only grows (a request's tokens, or a fixed text)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max(min_n, max_n)
        self._seen: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after it
        self._indexed = 0  # n-grams ending before this position are in _seen

    def _index(self, corpus: list[int] | tuple[int, ...], end: int) -> None:
        n = self.min_n
        for e in range(max(self._indexed, n), end):
            at = self._seen.setdefault(tuple(corpus[e - n : e]), [])
            at.append(e)
            if len(at) > _KEEP:
                del at[0]
        self._indexed = max(self._indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the best earlier occurrence of the sequence's end ([] if none)."""
        # every n-gram but the one ending the sequence (indexed once the sequence has grown past it)
        return self.find(tokens, len(tokens), tokens, k)

    def find(self, corpus: list[int] | tuple[int, ...], end: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed, in `corpus` (indexed up to `end`), the best occurrence of the
        end of `tokens` ([] if none)."""
        n = self.min_n
        if k <= 0 or len(tokens) < n:
            return []
        self._index(corpus, end)
        best, best_len = -1, 0
        last = len(tokens)
        for e in self._seen.get(tuple(tokens[last - n :]), ()):
            length = n
            while (
                length < self.max_n
                and e - length > 0
                and last - length > 0
                and corpus[e - length - 1] == tokens[last - length - 1]
            ):
                length += 1
            if length >= best_len:  # positions ascend: a tie goes to the latest
                best, best_len = e, length
        return [] if best < 0 else list(corpus[best : best + k])
