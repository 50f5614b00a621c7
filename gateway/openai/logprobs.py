"""Token log-probabilities in OpenAI's two shapes: chat (`logprobs.content[]` with exact bytes) and the
legacy completions one (parallel lists plus `text_offset`).

A byte-level BPE token can hold part of a UTF-8 character, so its text alone loses information; OpenAI
sends the token's exact bytes beside it, and so do we (from the byte-level spelling when the vocabulary
is byte-level, else from the decoded text).
"""

from __future__ import annotations

from functools import lru_cache

from cloud.model.spm_tokenizer import byte_piece_value
from cloud.model.tokenizer import Tokenizer
from shared.engine_types import SampleResult
from shared.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 bytes is spelled by one printable char."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """Text and bytes of single tokens, memoised per id (a vocabulary is small and fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        tok = self._tokenizer
        spelling = tok.id_to_token(token_id) or ""
        decoder = _byte_decoder()
        if (
            tok.byte_level
            and token_id not in tok.special_ids
            and spelling
            and all(c in decoder for c in spelling)
        ):
            raw = bytes(decoder[c] for c in spelling)
            return raw.decode("utf-8", errors="replace"), list(raw)
        byte = byte_piece_value(spelling) if tok.byte_fallback else None
        if byte is not None:  # SentencePiece's "<0xE2>": one byte of a character
            return bytes([byte]).decode("utf-8", errors="replace"), [byte]
        text = spelling if token_id in tok.special_ids else tok.decode([token_id], skip_special=False)
        return text, list(text.encode())

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def chat_logprobs(texts: TokenTexts, samples: list[SampleResult]) -> list[TokenLogprob]:
    out = []
    for s in samples:
        token, raw = texts.get(s.token_id)
        tops = [TopLogprob(token=t, logprob=lp, bytes=b) for t, b, lp in _tops(texts, s)]
        out.append(TokenLogprob(token=token, logprob=_lp(s.logprob), bytes=raw, top_logprobs=tops))
    return out


def append_completion_logprobs(
    texts: TokenTexts, samples: list[SampleResult], into: CompletionLogprobs, offset: int
) -> int:
    """Add `samples` to the legacy lists; returns the text offset after them."""
    for s in samples:
        token = texts.text(s.token_id)
        into.tokens.append(token)
        # an echoed prompt's first token has nothing before it: null, as OpenAI answers
        into.token_logprobs.append(None if s.logprob is None else _lp(s.logprob))
        into.top_logprobs.append(None if s.logprob is None else {t: lp for t, _, lp in _tops(texts, s)})
        into.text_offset.append(offset)
        offset += len(token)
    return offset


def _tops(texts: TokenTexts, s: SampleResult) -> list[tuple[str, list[int], float]]:
    return [(*texts.get(tid), _lp(lp)) for tid, lp in s.top_logprobs]


def _lp(lp: float | None) -> float:
    # JSON has no -inf; OpenAI clamps impossible tokens to a large negative number the same way
    if lp is None or lp != lp:
        return -9999.0
    return max(lp, -9999.0)
