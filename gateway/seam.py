"""What the gateway needs from an engine, behind one small interface over torch-free types
(shared/engine_types.py). The engines behind it live in cloud/serving/: in this process
(in_process.py) or in a child process (process.py); `ctxfuse serve` builds one and hands it in.

Submission is separate from iteration: `submit` returns only once the engine has accepted the request
(or raised the client's mistake, or QueueFullError), so a refusal is an HTTP status and a stream can
start the moment the request is queued. Closing a `Generation` before it finishes aborts it in the
engine, which frees its KV blocks; every route closes its generation in a `finally`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import numpy as np

from cloud.model.tokenizer import Tokenizer
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, Pooling, RequestOutput, SamplingParams


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
    # the engine's --context-overflow: drop_old_turns is the routes' to do, where the chat is rendered
    context_overflow: str

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

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> np.ndarray:
        """The inputs' L2-normalized embeddings [inputs, hidden_size] float32; the inputs must
        be checked (gateway/openai/embeddings.py). Cancelling drops the work."""

    def stats(self) -> EngineStats: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...
