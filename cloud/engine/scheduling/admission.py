"""What a request must satisfy before it is queued: the checks that need only the model's vocabulary,
its context and the overflow policy. Small and picklable, so a gateway whose engine core runs in
another process (engine_process.py) refuses a bad request itself, with the same reason, before it
crosses the process boundary."""

from __future__ import annotations

from dataclasses import dataclass

from cloud.engine.kv.prune_plan import PruneLimit
from cloud.engine.scheduling.overflow import OverflowPolicy
from shared.engine_types import SamplingParams, check_text_size
from shared.errors import ContextLengthExceededError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class Admission:
    vocab_size: int
    max_model_len: int
    overflow: OverflowPolicy
    prune: PruneLimit | None = None  # with --kv-prune-budget: the prompts whose pruning fits the pool

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.overflow.default_max_tokens(num_prompt_tokens)

    def check_text_size(self, num_chars: int, max_token_bytes: int | None) -> None:
        check_text_size(self.overflow.policy, self.max_model_len, num_chars, max_token_bytes)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the client's mistake, if any, before anything is queued."""
        params.validate(self.vocab_size)
        prompt_token_ids, _ = self.overflow.fit(prompt_token_ids, params)
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("the prompt holds a token id outside the vocabulary", param="prompt")
        if self.prune is not None:
            self.prune.check(n)
        limit = self.max_model_len
        if self.overflow.any_length:
            return
        if n >= limit:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens"
            )
        if n + params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens and "
                f"max_tokens is {params.max_tokens} (at most {limit - n} fit)",
                param="max_tokens",
            )
