"""The router's text-chunk keys through its memo equal the joined text hashed whole, turn after turn,
whatever the messages hold (non-ASCII, empty, exact chunk multiples); a next turn goes on from its
earlier turn's hashing, never from another tenant's, and an edited message is hashed anew."""

from __future__ import annotations

import random

import msgspec
import pytest

from gateway.backends.fleet.keys import RequestKeys, chat_text_keys
from gateway.backends.fleet.text_memo import TEXT_CHUNK_CHARS, TextMemo, _Hashing, text_chunk_keys
from shared.protocol import ChatCompletionRequest

ALPHABET = 'abcdefghij klmnop\n"\\é漢字🙂'


def _piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return "user: "
    if kind < 0.2:  # ends a chunk exactly, with the newline before it or without
        return "x" * (TEXT_CHUNK_CHARS * rng.randint(1, 2) - rng.randint(0, 1))
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 2500)))


@pytest.mark.parametrize("seed", range(8))
def test_a_conversation_turn_after_turn_keys_as_its_text_hashed_whole(seed: int) -> None:
    rng = random.Random(seed)
    memo = TextMemo()
    pieces: tuple[str, ...] = ()
    for _ in range(12):
        pieces += tuple(_piece(rng) for _ in range(rng.randint(1, 3)))
        assert memo.keys(pieces, b"tenant") == text_chunk_keys("\n".join(pieces))
        if rng.random() < 0.3:  # a regenerated last answer: the same run but its end
            pieces = (*pieces[:-1], _piece(rng))


def test_a_chat_request_keys_by_the_pieces_prompt_text_joins() -> None:
    memo = TextMemo()
    parts = [{"type": "text", "text": "é" * 900}, {"type": "text", "text": "b" * 700}]
    messages = [{"role": "system", "content": "s" * 1500}, {"role": "user", "content": parts}]
    req = msgspec.convert({"model": "m", "messages": messages}, ChatCompletionRequest)
    keys = chat_text_keys(req, b"", memo)
    assert keys.text_chunks() == text_chunk_keys(keys.text) == RequestKeys([], keys.text).text_chunks()
    assert len(keys.text_chunks()) == len(keys.text) // TEXT_CHUNK_CHARS == 3


def _poison(memo: TextMemo) -> None:
    """Every remembered run's keys replaced: whatever goes on from one shows it."""
    for remembered in memo._runs.values():
        remembered.hashing.keys[:] = [b"poisoned" * 2] * len(remembered.hashing.keys)


def test_a_next_turn_goes_on_from_its_own_tenants_earlier_turn_only() -> None:
    memo = TextMemo()
    first = ("system: " + "d" * 3000, "user: what does it say?")
    memo.keys(first, b"tenant-a")
    _poison(memo)
    nxt = (*first, "assistant: it says d", "user: and then?")
    # another tenant with the same conversation: hashed anew, so untouched by a's entry
    assert memo.keys(nxt, b"tenant-b") == text_chunk_keys("\n".join(nxt))
    # the same tenant: its earlier turn is used (here, poisoned, which shows it was)
    assert memo.keys(nxt, b"tenant-a")[0] == b"poisoned" * 2


def test_an_edited_earlier_message_of_the_same_length_is_hashed_anew() -> None:
    memo = TextMemo()
    first = ("system: " + "a" * 3000, "user: q")
    memo.keys(first, b"")
    _poison(memo)
    edited = ("system: " + "b" * 3000, "user: q", "assistant: r")
    assert memo.keys(edited, b"") == text_chunk_keys("\n".join(edited))


def test_the_memo_keeps_at_most_its_bound_least_recently_used_dropped_first() -> None:
    memo = TextMemo(max_chats=3)
    chats = [(f"user: {i}" * 400,) for i in range(4)]
    for chat in chats[:3]:
        memo.keys(chat, b"")
    memo.keys(chats[0], b"")  # used again: now the most recent
    memo.keys(chats[3], b"")
    assert len(memo) == 3
    _poison(memo)
    assert memo.keys((*chats[1], "user: more"), b"") == text_chunk_keys("\n".join((*chats[1], "user: more")))
    assert memo.keys((*chats[0], "user: more"), b"")[0] == b"poisoned" * 2


def test_hashing_state_fed_in_pieces_equals_fed_whole() -> None:
    rng = random.Random(7)
    text = "".join(rng.choice(ALPHABET) for _ in range(5 * TEXT_CHUNK_CHARS + 17))
    cuts = sorted(rng.sample(range(len(text)), 9))
    whole = text_chunk_keys(text)
    from hashlib import blake2b

    fed = _Hashing(blake2b(digest_size=16), "", [])
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        fed = fed.copy().feed(text[a:b])
    assert fed.keys == whole
