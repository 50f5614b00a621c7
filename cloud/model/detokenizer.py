"""Streaming detokenization: turn token ids, as they are sampled, into finished text.

A byte-level token can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens), so
the text of the newest tokens may end in U+FFFD until the next token completes it. We follow vLLM's
two offsets over the id list:
    ids[prefix_offset:read_offset]  already emitted; decoded again only as context
    ids[read_offset:]               not yet emitted
Each step decodes `ids[prefix_offset:]` and emits what follows the context's text, unless that tail
ends in U+FFFD. Invariant: `prefix_offset` sits on a character boundary (it only moves to a point
whose text did not end in U+FFFD), and UTF-8 resynchronises at such a boundary, so the window's text
starts exactly where the emitted text stopped. Hence the pieces concatenate to `decode(all ids)`,
and each step costs a few tokens of decoding, not the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decodes one generated sequence. Not thread-safe: one decoder per request."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def ids(self) -> Sequence[int]:
        return self._ids

    def feed(self, new_ids: Iterable[int]) -> str:
        """Append sampled ids; return the text they complete ("" while a character is still partial)."""
        self._ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Text still held back at the end of the sequence (a trailing partial character, as U+FFFD)."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        window = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(window) <= len(context) or (window.endswith(_REPLACEMENT) and not final):
            # Nothing new (e.g. only skipped special tokens) or a character still open: hold back.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(context) :]
