"""Turning a request's output stream into results: per-choice accumulation for whole responses, usage
tallies for both whole and streamed responses, and the rule for what an engine finish means to a client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.openai.logprobs import TokenTexts
from gateway.ops.metrics import RequestMeter
from gateway.ops.observe import annotate
from gateway.seam import Backend, Generation
from shared.engine_types import RequestOutput, SampleResult
from shared.errors import EngineError
from shared.protocol import CompletionTokensDetails, PromptTokensDetails, StructuredResult, Usage


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)
    prompt_samples: list[SampleResult] = field(default_factory=list)  # echo with logprobs
    finish_reason: str | None = None
    failure: StructuredResult | None = None  # why it ended in error (choice_failure)


@dataclass(slots=True)
class UsageTally:
    """Prompt tokens count once per prompt (its n choices share its blocks); outputs per choice. A
    chat's dropped old turns (gateway/openai/history.py) start the truncated counts."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    truncated_tokens: int = 0
    truncated_messages: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: drafted for the choices, and of those accepted
    accepted_tokens: int = 0
    _prompts: set[int] = field(default_factory=set)

    def add(self, out: RequestOutput, prompt_index: int = 0) -> None:
        if not out.finished:
            return
        self.completion_tokens += out.num_output_tokens
        self.draft_tokens += out.num_draft_tokens
        self.accepted_tokens += out.num_accepted_tokens
        if prompt_index not in self._prompts:
            self._prompts.add(prompt_index)
            self.prompt_tokens += out.num_prompt_tokens
            self.truncated_tokens += out.num_truncated_tokens
        if out.index == 0:
            # the first choice reports what the cache held before this request; later choices
            # reuse the first one's prompt blocks, which is not a cache hit for the client
            self.cached_tokens += out.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=self.cached_tokens,
                truncated_tokens=self.truncated_tokens,
                truncated_messages=self.truncated_messages,
            ),
            completion_tokens_details=CompletionTokensDetails(
                accepted_prediction_tokens=self.accepted_tokens,
                rejected_prediction_tokens=self.draft_tokens - self.accepted_tokens,
            ),
        )


def check_finish(out: RequestOutput) -> None:
    """Raise for a finish the client did not cause: an engine error, or an abort from elsewhere
    (shutdown). A choice that the request itself stopped short (its grammar reached a dead end) ends
    on its own, with finish_reason "error" and the reason under `ctxfuse` (choice_failure), and the
    request's other choices go on."""
    if out.finish_reason == "error" and out.error_code is not None:  # the request's own doing
        return
    if out.finish_reason == "error":
        raise EngineError(out.error or "the engine failed on this request")
    if out.finish_reason == "abort":
        raise EngineError("the request was aborted by the server (shutting down?)")


def choice_failure(out: RequestOutput) -> StructuredResult | None:
    """Why a finished choice ended in error by the request's own doing, as the client reads it."""
    if not out.finished or out.finish_reason != "error" or out.error_code is None:
        return None
    return StructuredResult(valid=False, error=out.error or out.error_code, code=out.error_code)


def visible_samples(out: RequestOutput, eos_ids: frozenset[int]) -> list[SampleResult]:
    """Logprobs of the tokens the client sees: an end-of-turn token that stopped the choice is not text."""
    if out.finished and out.finish_reason == "stop":
        return [s for s in out.logprobs if s.token_id not in eos_ids]
    return out.logprobs


async def collect(
    gen: Generation, meter: RequestMeter, tally: UsageTally, eos_ids: frozenset[int], prompt_index: int = 0
) -> dict[int, ChoiceResult]:
    """Every choice of one generation, by choice index."""
    choices: dict[int, ChoiceResult] = {}
    async for out in gen:
        check_finish(out)
        meter.observe(out, prompt_index)
        tally.add(out, prompt_index)
        c = choices.setdefault(out.index, ChoiceResult(out.index))
        c.text += out.text
        c.token_ids += out.token_ids
        c.samples += visible_samples(out, eos_ids)
        if out.prompt_logprobs is not None:
            c.prompt_samples = out.prompt_logprobs
        if out.finished:
            c.finish_reason = out.finish_reason
            c.failure = choice_failure(out)
    return choices


async def metered(
    gen: Generation, meter: RequestMeter, tally: UsageTally, prompt_index: int = 0
) -> AsyncIterator[RequestOutput]:
    """The outputs of `gen`, observed and tallied; raises on an engine failure."""
    async for out in gen:
        check_finish(out)
        meter.observe(out, prompt_index)
        tally.add(out, prompt_index)
        yield out


def annotate_usage(tally: UsageTally) -> None:
    annotate(
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        cached_tokens=tally.cached_tokens,
        truncated_tokens=tally.truncated_tokens,
        truncated_messages=tally.truncated_messages,
    )


@dataclass(slots=True)
class Reply:
    """The parts of a response every chunk or body repeats (chat and legacy completions alike)."""

    id: str
    model: str
    created: int
    texts: TokenTexts
    eos_ids: frozenset[int]
    log_content: bool

    @classmethod
    def new(
        cls, id_prefix: str, request_id: str, backend: Backend, texts: TokenTexts, log_content: bool
    ) -> Reply:
        eos = backend.tokenizer.eos_ids
        return cls(f"{id_prefix}-{request_id}", backend.model_name, int(time.time()), texts, eos, log_content)
