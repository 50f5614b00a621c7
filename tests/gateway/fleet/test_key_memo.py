"""The router's key memo (gateway/backends/fleet/key_memo.py) keys a conversation's next turn from its
earlier turns, and its keys equal the whole computation's (KeyMaker without a memo: render, tokenize,
hash it all) exactly: turn after turn, after an edit in the middle, per tenant, with tools, and on a
conversation that branches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import msgspec
import pytest

from cloud.model.chat_template import ChatTemplate
from cloud.model.text_side import load_text_side
from cloud.model.tokenizer import Tokenizer
from cloud.text.prompt import render_chat_prompt
from gateway.backends.fleet.key_memo import KeyMemo
from gateway.backends.fleet.keys import KeyMaker, RequestKeys
from shared.block_hash import hash_block, salt_key
from shared.protocol import ChatCompletionRequest

Message = dict[str, Any]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
# text that tokenizes differently by what surrounds it, and that spells the template's own markers
TRICKY = ["Hi", " there\n\n", "naïve café 😀", "<|im_end|>", "<|im_start|>user\n", "  spaces  ", "", "1234"]


@pytest.fixture(scope="module")
def text_side() -> tuple[Tokenizer, ChatTemplate]:
    return load_text_side()


@pytest.fixture()
def makers(text_side: tuple[Tokenizer, ChatTemplate]) -> tuple[KeyMaker, KeyMaker]:
    """(the router's maker, with its memo; the whole computation, the reference)."""
    return KeyMaker(*text_side), KeyMaker(*text_side, memo=False)


def request(messages: list[Message], **body: object) -> ChatCompletionRequest:
    raw = msgspec.json.encode({"model": "m", "messages": messages, **body})
    return msgspec.json.decode(raw, type=ChatCompletionRequest)


def keyed_alike(
    makers: tuple[KeyMaker, KeyMaker], messages: list[Message], extra_key: bytes = b"", **body: object
) -> RequestKeys:
    """The memo's keys of the request, checked equal to the reference's; the memo's returned."""
    memo, whole = makers
    req = request(messages, **body)
    got, want = memo.chat(req, True, extra_key), whole.chat(req, True, extra_key)
    assert got.token_ids == want.token_ids
    for block_size in (4, 16):
        assert got.blocks(block_size) == want.blocks(block_size)
    return got


def turns(n: int, start: int = 0) -> list[Message]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{TRICKY[i % len(TRICKY)]} turn {i}"}
        for i in range(start, start + n)
    ]


def test_each_next_turn_reuses_the_last_and_keys_as_the_whole_conversation(
    makers: tuple[KeyMaker, KeyMaker],
) -> None:
    messages: list[Message] = [{"role": "system", "content": "Be brief. " * 40}]
    for i in range(12):
        messages = messages + turns(2, 2 * i)[:1]
        keys = keyed_alike(makers, messages)
        if i == 0:
            assert keys.earlier is None
        else:  # all but the new tail: the earlier prompt ends with the assistant's opening marker
            assert keys.earlier is not None
            assert keys.earlier.shared_tokens >= len(keys.token_ids) - 40
        messages = messages + turns(2, 2 * i)[1:]


def test_a_retry_of_the_same_request_reuses_all_of_it(makers: tuple[KeyMaker, KeyMaker]) -> None:
    messages = [{"role": "user", "content": "naïve café 😀 " * 30}]
    first = keyed_alike(makers, messages)
    again = keyed_alike(makers, messages)
    assert first.earlier is None
    assert again.earlier is not None and again.earlier.shared_tokens == len(again.token_ids)


def test_an_edit_in_the_middle_reuses_only_what_precedes_it(makers: tuple[KeyMaker, KeyMaker]) -> None:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(5):  # the turns the router saw: what an edited history finds remembered
        messages = messages + turns(2, 2 * i)
        before = keyed_alike(makers, messages[:-1])
    for i, edit in ((5, " (edited)"), (3, "<|im_end|>"), (1, "x")):
        edited = {**messages[i], "content": messages[i]["content"] + edit}
        messages = [*messages[:i], edited, *messages[i + 1 :]]
        keys = keyed_alike(makers, messages[:-1])
        if i == 1:  # no turn the router saw ends before it
            assert keys.earlier is None
            continue
        assert keys.earlier is not None
        common = next(
            (n for n, (a, b) in enumerate(zip(before.token_ids, keys.token_ids, strict=False)) if a != b),
            min(len(before.token_ids), len(keys.token_ids)),
        )
        assert keys.earlier.shared_tokens <= common
        before = keys


def test_a_conversation_that_branches_keys_each_branch_from_their_common_turns(
    makers: tuple[KeyMaker, KeyMaker],
) -> None:
    trunk = [{"role": "system", "content": "Be brief."}, *turns(5)]
    keyed_alike(makers, trunk)
    for answer in ("Yes.", "No: <|im_end|> is a marker.", "Yes."):  # a regenerated answer, and back
        branch = [*trunk, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        keys = keyed_alike(makers, branch)
        assert keys.earlier is not None
    shorter = keyed_alike(makers, trunk[:3])  # back to an earlier turn: nothing longer matches
    assert shorter.earlier is None


def test_tenants_never_share_a_remembered_prompt(makers: tuple[KeyMaker, KeyMaker]) -> None:
    messages = [{"role": "user", "content": "The same question, word for word. " * 20}]
    a = keyed_alike(makers, messages, salt_key("a"))
    b = keyed_alike(makers, messages, salt_key("b"))
    assert a.earlier is None and b.earlier is None
    assert not set(a.blocks(16)) & set(b.blocks(16))
    later = [*messages, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "More?"}]
    assert keyed_alike(makers, later, salt_key("a")).earlier is not None
    assert keyed_alike(makers, later, salt_key("c")).earlier is None


def test_a_salted_copy_hashes_with_its_salt_whatever_was_hashed_before(
    makers: tuple[KeyMaker, KeyMaker],
) -> None:
    """The router salts a request's keys after tokenizing it (dataclasses.replace shares the chains)."""
    memo, _ = makers
    messages = [{"role": "user", "content": "Hello there. " * 20}]
    memo.chat(request(messages), True).blocks(16)
    keys = memo.chat(request([*messages, *turns(2, 1)]), True)
    plain = keys.blocks(16)
    salted = replace(keys, extra_key=salt_key("t"))
    chain, parent = [], None
    for i in range(len(keys.token_ids) // 16):
        parent = hash_block(parent, keys.token_ids[i * 16 : (i + 1) * 16], salt_key("t"))
        chain.append(parent)
    assert salted.blocks(16) == chain != plain


def test_tools_and_template_variables_are_part_of_the_conversation(
    makers: tuple[KeyMaker, KeyMaker],
) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    keyed_alike(makers, messages, tools=[TOOL])
    later = [*messages, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
    assert keyed_alike(makers, later, tools=[TOOL]).earlier is not None
    assert keyed_alike(makers, later, tools=[TOOL], tool_choice="required").earlier is None
    assert keyed_alike(makers, later).earlier is None
    assert keyed_alike(makers, later, chat_template_kwargs={"enable_thinking": False}).earlier is None


def test_threads_keying_their_own_conversations_at_once_key_each_exactly(
    makers: tuple[KeyMaker, KeyMaker],
) -> None:
    def conversation(c: int) -> None:
        messages: list[Message] = [{"role": "system", "content": f"Conversation {c}."}]
        for i in range(6):
            messages = messages + turns(2, c + 2 * i)
            keyed_alike(makers, messages[:-1])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(conversation, range(8)))


def test_the_memo_drops_the_least_recently_used_prompt(text_side: tuple[Tokenizer, ChatTemplate]) -> None:
    tokenizer, template = text_side
    memo = KeyMemo(tokenizer, max_entries=2)
    texts = {
        name: template.render([{"role": "user", "content": f"{name} " * 10}]) for name in ("a", "b", "c")
    }
    memo.tokens([b"a"], texts["a"])
    memo.tokens([b"b"], texts["b"])
    assert memo.tokens([b"a", b"a2"], texts["a"] + "more").earlier is not None  # a, used again
    assert len(memo) == 2  # a2 came; b, least recently used, went
    assert memo.tokens([b"b", b"b2"], texts["b"] + "more").earlier is None
    assert memo.tokens([b"a2", b"a3"], texts["a"] + "more, again").earlier is not None


def test_the_memo_holds_no_more_bytes_than_it_may(text_side: tuple[Tokenizer, ChatTemplate]) -> None:
    tokenizer, template = text_side
    text = template.render([{"role": "user", "content": "word " * 500}])
    memo = KeyMemo(tokenizer, max_bytes=len(text) * 3)  # room for about one such prompt
    for d in (b"1", b"2", b"3"):
        memo.tokens([d], text + d.decode())
    assert len(memo) == 1
    assert memo.tokens([b"3", b"4"], text + "3 and more").earlier is not None


def test_the_planned_prompt_through_the_memo_is_the_plain_rendering(
    text_side: tuple[Tokenizer, ChatTemplate],
) -> None:
    """What a router planning for workers submits (KeyMaker.prompt, the seam's encode_chat) is what
    render_chat_prompt gives, turn after turn, with tools; a later turn starts from the earlier one."""
    tokenizer, template = text_side
    maker = KeyMaker(tokenizer, template)
    messages: list[Message] = [{"role": "system", "content": "Be brief."}]
    for n, tools in enumerate(([TOOL], [TOOL], None, None)):
        messages += turns(2, start=2 * n)
        messages[-1]["role"] = "user"
        got = maker.prompt(messages, tools, "auto" if tools else None, None, salt_key("t"))
        want = render_chat_prompt(template, tokenizer, messages, tools, "auto" if tools else None)
        assert got.token_ids == want.token_ids
        if n in (1, 3):  # the same tools as the turn before: the earlier prompt is found
            assert got.earlier is not None and got.earlier.shared_tokens > len(got.token_ids) // 2
    elsewhere = maker.prompt(messages, None, None, None, salt_key("u"))  # another tenant: from scratch
    assert elsewhere.earlier is None and elsewhere.token_ids == want.token_ids
