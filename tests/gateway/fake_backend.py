"""A scripted backend for what the real engine will not do on demand: fail mid-stream, refuse with a
full queue. It uses the real tokenizer, so requests are planned exactly as for the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cloud.model.tokenizer import Tokenizer
from shared.engine_types import ChatPrompt, EngineStats, ImageSpan, RequestOutput, SamplingParams
from shared.errors import QueueFullError


@dataclass
class ScriptedGeneration:
    request_id: str
    outputs: list[RequestOutput]
    closed: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        for o in self.outputs:
            yield o

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeBackend:
    tokenizer: Tokenizer
    model_name: str = "fake"
    max_model_len: int = 2048
    context_overflow: str = "error"
    script: list[RequestOutput] = field(default_factory=list)
    queue_full: bool = False
    generations: list[ScriptedGeneration] = field(default_factory=list)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        return ChatPrompt(self.tokenizer.encode(" ".join(str(m["content"]) for m in messages)))

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return max(1, self.max_model_len - num_prompt_tokens)

    def check_text_size(self, num_chars: int) -> None:
        pass  # the fake refuses nothing by size

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.tokenizer.vocab_size)

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> ScriptedGeneration:
        if self.queue_full:
            raise QueueFullError("the waiting queue is full (0 requests)", retry_after_s=3)
        gen = ScriptedGeneration(request_id, list(self.script))
        self.generations.append(gen)
        return gen

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 10, 10, 0.0, 1, 0, 0)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def out(text: str, *, finish: str | None = None, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        index=0,
        text=text,
        token_ids=[1] if text else [],
        finished=finish is not None,
        finish_reason=finish,
        num_prompt_tokens=3,
        num_output_tokens=1,
        error=error,
    )
