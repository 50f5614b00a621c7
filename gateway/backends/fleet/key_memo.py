"""What the router remembers of a conversation between its turns, so that keying its next turn costs
the new tail rather than the whole conversation: the rendered prompt, its token ids, where special
tokens start in it, and the block-hash chains the router computed for it.

Why reusing token ids is exact. The tokenizer first cuts a text at its added tokens (`<|im_start|>`,
`<|im_end|>`, ...) and then tokenizes each piece between them on its own. So when a new prompt's text
equals a remembered one up to the end of a special token that started at char `q` (token `k`), the
new prompt's tokens are the remembered ones before `k` followed by the tokens of the new text from `q`
on. Two things could break that, and both are ruled out: a longer added token matching across the cut
(a special token is a cut only where no vocabulary entry holds its text other than at its end:
`cuttable_ids`), and a tail that does not start with that special token after all (checked: else the
whole prompt is tokenized). The text is always compared: digests only find a candidate.

Invariant: an entry's `token_ids` are `tokenizer.encode(text)`, and its chains hash those ids.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import msgspec

from cloud.model.tokenizer import Tokenizer

MEMO_ENTRIES = 4096  # prompts remembered, all tenants together (LRU)
MEMO_BYTES = 256 * 2**20  # and their size: ~200 KB for a 16,000-token conversation

# (block size, extra key) -> the chain of block hashes; block size 0 holds the text-chunk keys
Chains = dict[tuple[int, bytes], list[bytes]]


@dataclass(frozen=True, slots=True)
class Remembered:
    """One keyed prompt. The arrays are parallel over its cuttable special tokens, in order."""

    text: str
    token_ids: array[int]
    cut_starts: array[int]  # the char where the token's span starts
    cut_ends: array[int]  # and where it ends
    cut_tokens: array[int]  # its index in token_ids
    chains: Chains  # the request's own (RequestKeys): filled as the router hashes its blocks

    def size(self) -> int:
        """Bytes held, roughly: the text, the arrays, and one chain of 16-token blocks (~50 bytes a
        hash with its object), which the router adds after the entry is made."""
        arrays = (self.token_ids, self.cut_starts, self.cut_ends, self.cut_tokens)
        return sys.getsizeof(self.text) + sum(a.itemsize * len(a) for a in arrays) + len(self.token_ids) * 3


@dataclass(frozen=True, slots=True)
class Earlier:
    """Block hashes to start from: an earlier prompt's chains, whose first `shared_tokens` token ids
    this prompt shares."""

    shared_tokens: int
    chains: Chains

    def leading(self, block_size: int, extra_key: bytes) -> list[bytes]:
        chain = self.chains.get((block_size, extra_key), [])
        return chain[: self.shared_tokens // block_size]


@dataclass(frozen=True, slots=True)
class Tokens:
    token_ids: list[int]
    earlier: Earlier | None  # None: nothing to start the chains from
    chains: Chains  # for the request's keys to fill: the memo's entry holds the same dict


def conversation_digests(context: Any, messages: list[dict[str, Any]]) -> list[bytes]:
    """[i] names `context` (the tenant's extra key, tools, template variables: anything besides the
    messages that changes the prompt) and messages[: i + 1]."""
    out = []
    h = hashlib.blake2b(msgspec.json.encode(context, order="deterministic"), digest_size=16)
    for m in messages:
        h.update(msgspec.json.encode(m, order="deterministic"))
        out.append(h.digest())
    return out


def cuttable_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Special tokens a prompt may be cut before: those whose text no vocabulary entry holds other
    than at its end (such an added token, longer, could match across the cut). The vocabulary is a
    superset of the added tokens, which are all the tokenizer matches before splitting."""
    texts = {i: tokenizer.id_to_token(i) for i in tokenizer.special_ids}
    by_text = {t: i for i, t in texts.items() if t}
    if not by_text:
        return frozenset()
    lengths = sorted({len(t) for t in by_text})
    # where a special token's text could start in a piece: at one of their first characters
    first_chars = re.compile("[" + "".join(re.escape(c) for c in {t[0] for t in by_text}) + "]")
    spoiled: set[int] = set()
    for v in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(v)
        if piece is not None and len(piece) > lengths[0]:
            spoiled.update(_held_before_the_end(piece, by_text, lengths, first_chars))
    return frozenset(by_text.values()) - spoiled


def _held_before_the_end(
    piece: str, by_text: dict[str, int], lengths: list[int], first_chars: re.Pattern[str]
) -> list[int]:
    """The special tokens whose text `piece` holds other than at its end (held at its end is
    harmless: that longer token ends where the special one does)."""
    held = []
    for at in first_chars.finditer(piece):
        i = at.start()
        held += [
            by_text[piece[i : i + n]] for n in lengths if i + n < len(piece) and piece[i : i + n] in by_text
        ]
    return held


class KeyMemo:
    """Remembered prompts by conversation digest, least recently used dropped first. Called from
    worker threads (the router tokenizes off its event loop): the table is locked, tokenizing is not."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int = MEMO_ENTRIES, max_bytes: int = MEMO_BYTES):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Remembered] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @cached_property
    def _cuttable(self) -> frozenset[int]:
        # on first use, off the router's event loop: it reads the whole vocabulary (~50 ms for 49K)
        return cuttable_ids(self.tokenizer)

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, digests: list[bytes], text: str) -> Tokens:
        """`text`'s token ids, from the longest remembered prompt of the conversation `digests` names
        where it shares text; then `text` is remembered under digests[-1]."""
        before = self._find(digests)
        found = None if before is None else self._extend(before, text)
        now, shared = found if found is not None else (self._whole(text), 0)
        self._put(digests[-1], now)
        earlier = Earlier(shared, before.chains) if before is not None and shared else None
        return Tokens(now.token_ids.tolist(), earlier, now.chains)

    def _find(self, digests: list[bytes]) -> Remembered | None:
        with self._lock:
            for d in reversed(digests):
                entry = self._entries.get(d)
                if entry is not None:
                    self._entries.move_to_end(d)
                    return entry
        return None

    def _put(self, digest: bytes, entry: Remembered) -> None:
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old.size()
            self._entries[digest] = entry
            self._bytes += entry.size()
            while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and self._entries):
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size()

    def _whole(self, text: str) -> Remembered:
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return self._remembered(text, array("I"), _Cuts(), ids, offsets, 0, 0)

    def _extend(self, before: Remembered, text: str) -> tuple[Remembered, int] | None:
        """The prompt `text` from `before`'s tokens up to its last special token whose text `text`
        shares, and how many leading tokens the two share; None: no such token, tokenize it all."""
        if text == before.text:  # a retry, or another choice of the same prompt
            return replace(before, chains={}), len(before.token_ids)
        j = _last_shared_cut(before, text)
        if j < 0:
            return None
        q, k = before.cut_starts[j], before.cut_tokens[j]
        ids, offsets = self.tokenizer.encode_with_offsets(text[q:])
        if not ids or ids[0] != before.token_ids[k]:
            return None
        kept = _Cuts(before.cut_starts[:j], before.cut_ends[:j], before.cut_tokens[:j])
        return self._remembered(text, before.token_ids[:k], kept, ids, offsets, q, k), k + 1

    def _remembered(
        self,
        text: str,
        head: array[int],
        cuts: _Cuts,
        ids: list[int],
        offsets: list[tuple[int, int]],
        q: int,
        k: int,
    ) -> Remembered:
        """`head` (k token ids) and their `cuts`, then `ids` tokenized from char `q` of `text`."""
        for i, t in enumerate(ids):
            if t in self._cuttable:
                cuts.starts.append(q + offsets[i][0])
                cuts.ends.append(q + offsets[i][1])
                cuts.tokens.append(k + i)
        return Remembered(text, head + array("I", ids), cuts.starts, cuts.ends, cuts.tokens, {})


@dataclass(slots=True)
class _Cuts:
    """Where a prompt's cuttable special tokens are: char spans and token indices, in order."""

    starts: array[int] = field(default_factory=lambda: array("q"))
    ends: array[int] = field(default_factory=lambda: array("q"))
    tokens: array[int] = field(default_factory=lambda: array("q"))


def _last_shared_cut(before: Remembered, text: str) -> int:
    """The last cut of `before` whose special token ends where `text` still equals `before.text`
    (-1: none). Sharing text up to a char is monotone in the char: bisected."""
    ends, old = before.cut_ends, before.text
    if text.startswith(old):  # the usual next turn: the whole earlier prompt, then more
        return len(ends) - 1
    lo, hi = 0, len(ends)  # cuts before lo are shared, from hi on are not
    while lo < hi:
        mid = (lo + hi) // 2
        if text.startswith(old[: ends[mid]]):
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
