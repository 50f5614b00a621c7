"""SentencePiece BPE (GGUF tokenizer model "llama": Llama 2, Mistral, Gemma) on the Rust `tokenizers` BPE.

A GGUF stores the pieces, their scores and types, but no merges. SentencePiece BPE merges, at each
step, the adjacent pair whose joined piece ranks best (llama.cpp's llm_tokenizer_spm does exactly
this with the scores). A BPE model with one merge per split of every piece, ranked by the joined
piece's rank, runs the same algorithm; transformers' GGUF converter builds such a list too.

Ranks: pieces that are not normal (control, user-defined, byte) first in file order, then normal
pieces by score, best first, ties in file order. SentencePiece writes normal pieces in merge order
(score = -rank), so this is file order for them; Gemma scores every non-normal piece -1000, which
would otherwise push its whitespace-run pieces ("▁▁", ...) behind every word.

Spaces become "▁" before BPE (with a leading "▁" when the file says `add_space_prefix`); characters
no piece covers fall back to their UTF-8 bytes as `<0xXX>` pieces. Gemma stores its whitespace-run
pieces with real spaces ("  "); we spell them with "▁" so BPE can build them from the text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from shared.errors import ModelLoadError

if TYPE_CHECKING:
    from cloud.model.gguf_vocab import GGUFTokenizerData

SPACE = "\u2581"  # SentencePiece's visible space
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _pieces(tokens: list[str]) -> list[str]:
    """The BPE spelling of each token: whitespace runs stored with real spaces take "▁" for each."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def byte_piece_value(piece: str) -> int | None:
    """The byte a byte-fallback piece ("<0xE2>") stands for; None for any other piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def _merge_order(types: list[int], scores: list[float]) -> list[int]:
    """Token ids, best-ranked piece first (see the module docstring)."""
    special = [i for i, kind in enumerate(types) if kind != _NORMAL]
    # a stable sort: equal scores keep file order
    normal = sorted((i for i, kind in enumerate(types) if kind == _NORMAL), key=lambda i: -scores[i])
    return special + normal


def _merges(pieces: list[str], order: list[int]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, grouped by the joined piece in rank order; within
    one piece the longer left part first, as transformers orders them (such pairs never compete)."""
    vocab = set(pieces)
    merges: list[tuple[str, str]] = []
    for i in order:
        piece = pieces[i]
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def spm_backend_from_gguf(data: GGUFTokenizerData) -> _RustTokenizer:
    n = len(data.tokens)
    types = data.token_types or [_NORMAL] * n
    scores = data.scores or [0.0] * n
    if len(types) != n or len(scores) != n:
        raise ModelLoadError(f"GGUF lists {n} tokens but {len(types)} token types and {len(scores)} scores")
    pieces = _pieces(data.tokens)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != n:
        raise ModelLoadError("GGUF vocabulary holds duplicate token strings; ids would be ambiguous")
    unk = "<unk>" if "<unk>" in vocab else None
    model = models.BPE(
        vocab, _merges(pieces, _merge_order(types, scores)), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = _RustTokenizer(model)
    # SentencePiece treats the whole text as one word (split=False): "▁" is part of the pieces.
    prepend = "first" if data.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=prepend, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if data.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    # Control and user-defined tokens are matched whole in the raw text, as llama.cpp does, except
    # respelled whitespace runs: those are ordinary pieces that BPE builds from "▁".
    added = [
        AddedToken(token, special=kind == _CONTROL, normalized=False)
        for token, piece, kind in zip(data.tokens, pieces, types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED) and piece == token
    ]
    backend.add_tokens([t for t in added if not t.special])
    backend.add_special_tokens([t for t in added if t.special])
    if backend.get_vocab_size(with_added_tokens=True) != n:
        raise ModelLoadError("GGUF added tokens do not map onto the vocabulary")
    return backend


def spm_max_token_bytes(backend: _RustTokenizer) -> int:
    """The most bytes of text one token stands for: "▁" is one space, a `<0xXX>` piece one byte."""
    longest = 1
    for piece in backend.get_vocab(with_added_tokens=True):
        if byte_piece_value(piece) is None:
            longest = max(longest, len(piece.replace(SPACE, " ").encode()))
    return longest
