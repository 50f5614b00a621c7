"""What the gateway needs from an engine, behind one small interface, and the in-process engine behind it.

Submission is separate from iteration: `submit` returns only once the engine has accepted the request
(or raised the client's mistake, or QueueFullError), so a refusal is an HTTP status and a stream can
start the moment the request is queued. Closing a `Generation` before it finishes aborts it in the
engine, which frees its KV blocks; every route closes its generation in a `finally`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import torch

from cloud.engine.async_engine import AsyncEngine
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore, EngineStats
from cloud.engine.embedding import Pooling
from cloud.engine.output import RequestOutput
from cloud.engine.request import ChatPrompt, ImageSpan, SamplingParams
from cloud.model.tokenizer import Tokenizer


class Generation(Protocol):
    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None:
        """Abort the request if any choice is unfinished; safe to call more than once."""


class Backend(Protocol):
    model_name: str
    max_model_len: int
    hidden_size: int  # the width of an embedding
    tokenizer: Tokenizer

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens for a request that sets none."""

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """The prompt of `messages` through the chat template, with `tools` (OpenAI's shape) in the
        prompt; `tool_choice`: None (the model decides), "required" or the forced function's name.
        Content may be a string or a list of text and image_features parts; `template_kwargs`: more
        variables for the chat template (a request's chat_template_kwargs)."""

    def check_text_size(self, num_chars: int) -> None:
        """Raise context_length_exceeded, before any tokenizing, for a prompt whose text alone
        (`num_chars` characters) cannot fit the context."""

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the client's mistake (shared.errors) without queueing anything."""

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> Generation:
        """Queue the request; a lower `priority` runs first (batch work sends a positive one);
        `image_spans` from encode_chat."""

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> torch.Tensor:
        """The inputs' L2-normalized embeddings [inputs, hidden_size] fp32 on the CPU; the inputs must
        be checked (gateway/openai/embeddings.py). Cancelling drops the work."""

    def stats(self) -> EngineStats: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class InProcessBackend:
    """The engine in this process: its core steps on its own thread (AsyncEngine)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        core = engine.core
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.hidden_size = core.model_config.hidden_size
        self.tokenizer = core.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> InProcessBackend:
        return cls(AsyncEngine(EngineCore(config)))

    @property
    def describe(self) -> tuple[str, ...]:
        """The lines `serve` prints at start-up: the device and the KV plan."""
        return (self.engine.core.describe_device(), self.engine.core.kv_plan.describe())

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        return self.engine.core.chat_prompt(messages, tools, tool_choice, template_kwargs)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.engine.core.default_max_tokens(num_prompt_tokens)

    def check_text_size(self, num_chars: int) -> None:
        self.engine.core.admission.check_text_size(num_chars, self.tokenizer.max_token_bytes)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.core.check(prompt_token_ids, params)

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> Generation:
        return await self.engine.open(
            prompt_token_ids, params, request_id=request_id, priority=priority, image_spans=image_spans
        )

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> torch.Tensor:
        return await self.engine.embed(inputs, pooling, request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def is_alive(self) -> bool:
        return self.engine.is_running()

    def shutdown(self) -> None:
        self.engine.shutdown()
