"""Per-field confidence of generated JSON, so a device can act only on the fields the model was sure
of. A leaf's confidence is the probability of the tokens that wrote it: exp of the sum of the
log-probabilities of every token whose text overlaps the leaf's literal.

Which characters "write" a leaf:
- a string's literal includes both quotes (the token that opens the string chose to start it, the
  one that closes it chose where it ends);
- a number's span reaches one character past its literal: JSON numbers have no closing mark, so
  the token carrying the delimiter after it is where the model decided the number was complete;
- a token with empty text (e.g. a byte-fallback token holding the first bytes of a multi-byte
  character, decoded as "" until the character completes) counts toward the character after it;
- characters no token covers (text the caller supplied) are certain.
A token overlapping two leaves counts for both.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from .json_scan import PathPart, find_leaves


def token_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Spans [start, end) in the joined text of consecutive per-token decoded pieces."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for piece in pieces:
        spans.append((offset, offset + len(piece)))
        offset += len(piece)
    return spans


def json_pointer(path: Sequence[PathPart]) -> str:
    """RFC 6901: '/'-joined reference tokens, '~' written '~0' and '/' written '~1'."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def field_confidence(
    text: str,
    spans: Sequence[tuple[int, int]],
    logprobs: Sequence[float],
    base: str = "",
) -> dict[str, float]:
    """Confidence in [0, 1] of each leaf (scalar or empty container) of the JSON value in `text`, keyed
    by `base` + its JSON Pointer (the root scalar's pointer is ""). Six significant digits, not
    fixed decimals: a long free string's joint probability can be tiny, and must not read as 0.

    `spans[i]` is the [start, end) of token i in `text` (str offsets), `logprobs[i]` its natural-log
    probability; tokens must be in text order. Returns {} when `text` is not one complete JSON value
    (surrounding whitespace allowed): reporting nothing beats guessing about a cut-off document."""
    tokens = _Tokens(spans, logprobs)
    leaves = find_leaves(text)
    if leaves is None:
        return {}
    confidence: dict[str, float] = {}
    for leaf in leaves:
        end = leaf.end + 1 if leaf.kind == "number" else leaf.end
        probability = math.exp(tokens.logprob_sum(leaf.start, end))
        # logprobs a hair above 0 (float noise in a softmax) must not report more than certainty
        confidence[base + json_pointer(leaf.path)] = float(f"{min(1.0, max(0.0, probability)):.6g}")
    return confidence


class _Tokens:
    """Tokens sorted by position, so those overlapping a span are one contiguous run found by
    bisection: O(log n) to find, and each leaf sums only its own tokens."""

    __slots__ = ("_ends", "_logprobs", "_starts")

    def __init__(self, spans: Sequence[tuple[int, int]], logprobs: Sequence[float]) -> None:
        if len(spans) != len(logprobs):
            raise ValueError(f"{len(spans)} spans but {len(logprobs)} logprobs")
        self._starts = [start for start, _ in spans]
        # an empty token occupies the character after it (see the module docstring)
        self._ends = [max(end, start + 1) for start, end in spans]
        self._logprobs = list(logprobs)
        for i, (start, end) in enumerate(spans):
            if end < start or (i > 0 and (start < self._starts[i - 1] or self._ends[i] < self._ends[i - 1])):
                raise ValueError(f"token span {i} {(start, end)} is reversed or out of text order")
            if math.isnan(logprobs[i]) or logprobs[i] == math.inf:
                raise ValueError(f"token {i} has log-probability {logprobs[i]}")

    def logprob_sum(self, start: int, end: int) -> float:
        """Sum of the logprobs of the tokens overlapping [start, end)."""
        first = bisect_right(self._ends, start)  # the first token ending after `start`
        stop = bisect_left(self._starts, end)  # tokens from here on start at or after `end`
        return math.fsum(self._logprobs[first:stop])
