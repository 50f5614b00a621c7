"""The event loop never blocks on a request's size (issue 17, finding 5): a prompt whose text alone
cannot fit the context is refused by its size before any tokenizing, and the template, tokenizer and
schema compilation of every request run on worker threads, never on the loop's thread.

Before: a 15 MiB prompt was templated and tokenized on the event loop, and `/health` waited 45.9 s
for it; the prompt was then refused for its length anyway."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from cloud.model.tokenizer import Tokenizer

from .conftest import MODEL, Served


def test_the_size_bound_never_exceeds_the_real_token_count(served: Served) -> None:
    """ceil(bytes / max_token_bytes) is a lower bound of the token count, on the texts that pack
    the most bytes into a token: the vocabulary's longest pieces and the special tokens."""
    tok: Tokenizer = served.backend.tokenizer
    assert tok.max_token_bytes is not None and tok.max_token_bytes >= 16
    texts = [
        "#" * 80 * 50,
        "\n" + " " * 4000,
        "<|im_start|>" * 300,
        "a" * 5000,
        "Ünïcödé ✓ 漢字 " * 200,
    ]
    for text in texts:
        least = -(-len(text.encode()) // tok.max_token_bytes)
        assert least <= len(tok.encode(text)), text[:20]


def test_a_prompt_too_long_for_the_context_is_refused_by_its_size_before_tokenizing(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_encode = served.backend.tokenizer.encode
    monkeypatch.setattr(
        served.backend.tokenizer, "encode", lambda *a, **kw: calls.append("encode") or real_encode(*a, **kw)
    )
    monkeypatch.setattr(served.backend, "encode_chat", _counting(served.backend.encode_chat, calls))
    text = "word " * 180_000  # 900,000 characters: at least 11,112 tokens for a 2,048-token context
    client = served.client()
    with pytest.raises(openai.BadRequestError) as chat_err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4
        )
    with pytest.raises(openai.BadRequestError) as completion_err:
        client.completions.create(model=MODEL, prompt=["hello", text], max_tokens=4)
    for err in (chat_err.value, completion_err.value):
        assert err.code == "context_length_exceeded"
        assert "900000 characters of text are at least" in err.message
    assert calls == []  # refused before the template or the tokenizer saw it


def _counting(fn: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        return fn(*args, **kwargs)

    return spy


def test_templates_and_tokenizing_run_off_the_event_loop_thread(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    monkeypatch.setattr(served.backend, "encode_chat", _counting(served.backend.encode_chat, threads))
    monkeypatch.setattr(
        served.backend.tokenizer, "encode", _counting(served.backend.tokenizer.encode, threads)
    )
    client = served.client()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        assert http.post("/tokenize", json=chat).status_code == 200
    assert len(threads) >= 4
    assert "test-gateway" not in threads  # the thread that runs the gateway's event loop
