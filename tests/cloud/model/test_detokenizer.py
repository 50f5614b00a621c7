"""Streaming detokenization emits only whole characters and adds up to the full decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.model.detokenizer import IncrementalDecoder
from cloud.model.tokenizer import Tokenizer

EMOJI_TEXT = (
    "Family 👩‍👩‍👧‍👦, flags 🇫🇷🇯🇵🇧🇷, skin 👍🏽👋🏿, fire ❤️‍🔥, astronaut 🧑🏿‍🚀, "
    "math 𝔸𝕓𝒸 ∑∫√, CJK 漢字かなカナ한글, combining é, arrows ⟶⟵, 😀😃😄😁😆😅🤣😂🙂🙃"
)


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    decoder = IncrementalDecoder(tok, skip_special=skip_special)
    pieces = [decoder.feed([i]) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def test_one_token_at_a_time_concatenates_to_decode(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == EMOJI_TEXT


def test_never_emits_a_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT)
    assert len(ids) > len(EMOJI_TEXT) // 2  # multi-token characters are really exercised
    assert all("\ufffd" not in piece for piece in _stream(tok, ids))


def test_chunks_of_several_ids_give_the_same_text(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT)
    decoder = IncrementalDecoder(tok)
    text = "".join(decoder.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + decoder.flush()
    assert text == EMOJI_TEXT
    assert decoder.ids == ids


def test_flush_releases_a_trailing_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1
    decoder = IncrementalDecoder(tok)
    assert decoder.feed(ids[:1]) == ""
    assert decoder.flush() == tok.decode(ids[:1])
    assert decoder.flush() == ""


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>")
    assert "".join(_stream(tok, ids)) == "hi"
    assert "".join(_stream(tok, ids, skip_special=False)) == "hi<|im_end|>"


def test_each_step_decodes_a_short_window(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(EMOJI_TEXT * 20)
    widths: list[int] = []
    real_decode = tok.decode

    def counting_decode(window: list[int], skip_special: bool = True) -> str:
        widths.append(len(window))
        return real_decode(window, skip_special)

    monkeypatch.setattr(tok, "decode", counting_decode)
    assert "".join(_stream(tok, ids)) == EMOJI_TEXT * 20
    # A window spans the last emitted step plus the ids of one still-open character.
    assert len(ids) > 1000
    assert max(widths) <= 8
