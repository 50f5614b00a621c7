"""The prefix keys of a request, as the router matches them.

- For ctxfuse workers: the engine's own chained block hashes of the prompt (cloud/engine/kv/block_pool.py
  `hash_block` over `block_size`-token blocks), from the same chat template and tokenizer the worker
  uses, so a key names exactly a KV block a worker may hold. Image spans are left out: a prompt with
  images matches up to its first image's block (the worker mixes the image hash in from there).
- For other OpenAI-compatible servers, which report nothing: hashes of the prompt's text in fixed
  chunks, chained the same way; the gateway learns who holds them from where it sent them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cloud.model.chat_template import ChatTemplate
from cloud.model.tokenizer import Tokenizer
from cloud.text.image_text import flatten_content
from cloud.text.prompt import render_chat_prompt, render_chat_text
from gateway.backends.fleet.key_memo import Chains, Earlier, KeyMemo, Tokens, conversation_digests
from gateway.backends.fleet.text_memo import TextMemo, text_chunk_keys
from gateway.openai import chat, structured
from shared.block_hash import hash_block
from shared.errors import CtxfuseError
from shared.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True, slots=True)
class RequestKeys:
    token_ids: list[int]  # the prompt (of the first prompt, for a completion with several)
    text: str  # the prompt's text, for text-chunk keys
    extra_key: bytes = b""  # the tenant's cache salt, as the worker mixes it in (block_pool.salt_key)
    # an earlier turn's chains over the token ids this prompt shares with it (key_memo.py)
    earlier: Earlier | None = field(default=None, compare=False, repr=False)
    # each chain is hashed once per request: matching and recording both read it. Keyed by the extra
    # key too, since a copy with the tenant's salt (dataclasses.replace) shares this dict.
    chains: Chains = field(default_factory=dict, compare=False, repr=False)
    # a chat's text as its messages' pieces (chat_text_keys), with the memo that keys it from an
    # earlier turn's (text_memo.py); without a memo, the text is hashed whole
    pieces: tuple[str, ...] = field(default=(), compare=False, repr=False)
    memo: TextMemo | None = field(default=None, compare=False, repr=False)

    def blocks(self, block_size: int) -> list[bytes]:
        hashes = self.chains.get((block_size, self.extra_key))
        if hashes is None:
            hashes = self.earlier.leading(block_size, self.extra_key) if self.earlier is not None else []
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), len(self.token_ids) // block_size):
                block = self.token_ids[i * block_size : (i + 1) * block_size]
                parent = hash_block(parent, block, self.extra_key)
                hashes.append(parent)
            self.chains[(block_size, self.extra_key)] = hashes
        return hashes

    def text_chunks(self) -> list[bytes]:
        out = self.chains.get((0, b""))  # 0: no block size has it
        if out is None:
            memo = self.memo
            out = memo.keys(self.pieces, self.extra_key) if memo is not None else text_chunk_keys(self.text)
            self.chains[(0, b"")] = out
        return out


class KeyMaker:
    """Prompt keys from the model's tokenizer and chat template (no weights). With `memo`, the next
    turn of a conversation reuses the tokens and block hashes of its earlier turns (key_memo.py)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, memo: bool = True) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.memo = KeyMemo(tokenizer) if memo else None

    def chat(
        self,
        req: ChatCompletionRequest,
        ctxfuse_backends: bool,
        extra_key: bytes = b"",
        text_memo: TextMemo | None = None,
    ) -> RequestKeys:
        """`ctxfuse_backends`: some candidate reports blocks (else tokenizing is wasted work).
        `extra_key`: the tenant's, as its keys mix it in; tenants never share a remembered prompt.
        `text_memo`: what keys its text from an earlier turn's (else it is hashed whole)."""
        text = chat_text_keys(req, extra_key, text_memo)
        if not ctxfuse_backends:
            return text
        try:
            tokens = self._chat_tokens(req, extra_key)
        except CtxfuseError:  # the backend will refuse it with the right error; route it by its text
            return text
        return replace(text, token_ids=tokens.token_ids, earlier=tokens.earlier, chains=tokens.chains)

    def _chat_tokens(self, req: ChatCompletionRequest, extra_key: bytes) -> Tokens:
        _, tools = structured.tools_structure(req, False)
        messages = chat.message_dicts(req.messages)
        return self.prompt(messages, tools.tools, tools.choice, req.chat_template_kwargs, extra_key)

    def prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_choice: str | None,
        template_kwargs: dict[str, Any] | None,
        extra_key: bytes,
    ) -> Tokens:
        """The chat's prompt token ids, equal to render_chat_prompt's: through the memo (from an
        earlier turn's tokens, in `extra_key`'s partition) unless the messages hold images."""
        flat, images = flatten_content(messages)
        if self.memo is None or images:  # the reference; and images, located by each token's offsets
            prompt = render_chat_prompt(
                self.template, self.tokenizer, messages, tools, tool_choice, template_kwargs
            )
            return Tokens(prompt.token_ids, None, {})
        text = render_chat_text(self.template, flat, tools, tool_choice, template_kwargs)
        context = (extra_key, tools, tool_choice, template_kwargs)
        return self.memo.tokens(conversation_digests(context, flat), text)

    def completion(
        self, req: CompletionRequest, ctxfuse_backends: bool, extra_key: bytes = b""
    ) -> RequestKeys:
        text = prompt_text(req)
        ids = self.tokenizer.encode(text, add_special=True) if text and ctxfuse_backends else []
        return RequestKeys(ids, text, extra_key)

    def prompt_tokens(self, req: ChatCompletionRequest | CompletionRequest, keys: RequestKeys) -> int:
        """The request's prompt tokens, as a worker will count them (for tokens per minute); `keys`
        from chat() or completion() with tokenizing on."""
        if isinstance(req, ChatCompletionRequest):
            # a prompt the template refused is routed by its text: counted by its text too
            return len(keys.token_ids) or len(self.tokenizer.encode(keys.text, add_special=True))
        p = req.prompt
        if isinstance(p, str):
            return len(keys.token_ids)
        if all(isinstance(x, int) for x in p):
            return len(p)
        return sum(
            len(x) if isinstance(x, list) else len(self.tokenizer.encode(x, add_special=True))
            for x in p
            if not isinstance(x, int)
        )


def chat_text_keys(req: ChatCompletionRequest, extra_key: bytes, text_memo: TextMemo | None) -> RequestKeys:
    """A chat's keys by its text alone (no token ids)."""
    pieces = _chat_pieces(req)
    return RequestKeys([], "\n".join(pieces), extra_key, pieces=pieces, memo=text_memo)


def _chat_pieces(req: ChatCompletionRequest) -> tuple[str, ...]:
    return tuple(f"{m.role}: {_text(m.content)}" for m in req.messages)


def prompt_text(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The prompt's text, for text-chunk keys: each message's role and text, or a completion's
    (first) prompt."""
    if isinstance(req, ChatCompletionRequest):
        return "\n".join(_chat_pieces(req))
    p = req.prompt
    return p if isinstance(p, str) else p[0] if p and isinstance(p[0], str) else ""


def _text(content: object) -> str:
    if isinstance(content, list):
        return "\n".join(p.text or "" for p in content if getattr(p, "text", None) is not None)
    return content if isinstance(content, str) else ""
