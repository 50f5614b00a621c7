"""The router names a request's prompt blocks exactly as the worker's engine does: the same token ids
from the tokenizer and chat template alone (no weights), hence the same chained block hashes."""

from __future__ import annotations

import msgspec

from cloud.model.text_side import load_text_side
from cloud.serving.in_process import InProcessBackend
from gateway.backends.fleet.keys import KeyMaker
from gateway.backends.fleet.text_memo import TEXT_CHUNK_CHARS
from gateway.openai import chat, structured
from shared.block_hash import hash_block
from shared.protocol import ChatCompletionRequest


def request(**body: object) -> ChatCompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"model": "m", **body}), type=ChatCompletionRequest)


def test_chat_keys_equal_the_engines_prompt_and_block_hashes(backend: InProcessBackend) -> None:
    maker = KeyMaker(*load_text_side())
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body in (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi " * 100}]},
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "tool_choice": "required"},
    ):
        req = request(**body)
        keys = maker.chat(req, ctxfuse_backends=True)
        _, tools = structured.tools_structure(req, False)
        engine_ids = backend.encode_chat(
            chat.message_dicts(req.messages), tools.tools, tools.choice
        ).token_ids
        assert keys.token_ids == engine_ids
        chain, parent = [], None
        for i in range(len(engine_ids) // 16):
            parent = hash_block(parent, engine_ids[i * 16 : (i + 1) * 16])
            chain.append(parent)
        assert keys.blocks(16) == chain


def test_text_chunk_keys_are_chained_over_the_conversation() -> None:
    maker = KeyMaker(*load_text_side())
    doc = "x" * (TEXT_CHUNK_CHARS * 3)
    a = maker.chat(request(messages=[{"role": "user", "content": doc + "one"}]), ctxfuse_backends=False)
    b = maker.chat(request(messages=[{"role": "user", "content": doc + "two"}]), ctxfuse_backends=False)
    c = maker.chat(request(messages=[{"role": "user", "content": "y" + doc}]), ctxfuse_backends=False)
    assert a.token_ids == [] and len(a.text_chunks()) == 3
    assert a.text_chunks() == b.text_chunks()  # the shared prefix, chunk by chunk
    assert not set(a.text_chunks()) & set(c.text_chunks())  # a chunk's key names all text before it
