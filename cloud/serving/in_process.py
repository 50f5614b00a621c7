"""The engine in this process, behind the gateway's Backend (gateway/seam.py): its core
steps on its own thread (AsyncEngine). `ctxfuse serve --engine-in-process` and `ctxfuse worker` run it."""

from __future__ import annotations

from typing import Any

import numpy as np

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.engine.serving.output_stream import RequestStream
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, Pooling, SamplingParams


class InProcessBackend:
    """The engine in this process: its core steps on its own thread (AsyncEngine)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        core = engine.core
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.hidden_size = core.model_config.hidden_size
        self.context_overflow: str = core.admission.overflow.policy
        self.tokenizer = core.tokenizer
        self.chat_template = core.chat_template
        self.block_size, self.max_num_seqs = core.kv_plan.block_size, core.config.max_num_seqs
        self.block_events = core.block_events  # the prefix cache's history (a worker's router reads it)

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
    ) -> RequestStream:
        return await self.engine.open(
            prompt_token_ids, params, request_id=request_id, priority=priority, image_spans=image_spans
        )

    async def embed(self, inputs: list[list[int]], pooling: Pooling, request_id: str) -> np.ndarray:
        vectors = await self.engine.embed(inputs, pooling, request_id)  # [inputs, hidden] fp32, CPU
        return vectors.numpy()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def is_alive(self) -> bool:
        return self.engine.is_running()

    def shutdown(self) -> None:
        self.engine.shutdown()
