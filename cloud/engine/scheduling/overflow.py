"""What the engine does with a request longer than its context (`--context-overflow`).

- error (default): refuse it up front with context_length_exceeded.
- truncate_middle: keep the prompt's head (system prompt, start of the document) and tail (the
  question and the assistant header) in equal shares, drop the middle, and report how many tokens
  went.
- sliding_window (StreamingLLM): run it past the context on its attention sinks plus a ring of
  recent blocks. Between steps such a request holds at most `ring_blocks` blocks, which leaves room
  for one step's chunk, so it never holds more KV than one context. The attention side (sink keys
  rotated to their in-cache distance) is in attention.py; the ring itself in kv_manager.py.
- drop_old_turns: a chat drops whole old turns before it is tokenized for the engine, where it is
  rendered (cloud/text/history.py, gateway/openai/history.py); the engine sees only token ids, so
  here it is error: a prompt that still does not fit is refused.
"""

from __future__ import annotations

from cloud.engine.config import ContextOverflow
from shared.engine_types import SamplingParams, default_max_tokens
from shared.errors import ContextLengthExceededError, InvalidRequestError


class OverflowPolicy:
    def __init__(
        self,
        policy: ContextOverflow,
        max_model_len: int,
        max_num_batched_tokens: int,
        sinks: int,
        block_size: int,
    ) -> None:
        self.policy = policy
        self.max_model_len = max_model_len
        self.sink_blocks = self.ring_blocks = 0
        if policy == "sliding_window":
            self.sink_blocks = -(-sinks // block_size)
            self.ring_blocks = (max_model_len - max_num_batched_tokens) // block_size
            if self.ring_blocks < self.sink_blocks + 2:
                raise InvalidRequestError(
                    f"--context-overflow sliding_window needs a context ({max_model_len}) longer than "
                    f"--max-num-batched-tokens ({max_num_batched_tokens}) plus the sinks ({sinks}) and "
                    "two blocks"
                )

    @property
    def any_length(self) -> bool:
        """Whether a prompt of any length runs (past the context, on a sliding window)."""
        return self.policy == "sliding_window"

    def slides(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request of this size runs on a sliding window (only those past the context do)."""
        return self.any_length and num_prompt_tokens + max_tokens > self.max_model_len

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return default_max_tokens(self.policy, self.max_model_len, num_prompt_tokens)

    def fit(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], int]:
        """The prompt to run and how many tokens truncate_middle dropped from it."""
        n, limit = len(prompt_token_ids), self.max_model_len
        if self.policy != "truncate_middle" or n + params.max_tokens <= limit:
            return prompt_token_ids, 0
        keep = limit - params.max_tokens
        if keep < 2:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limit} tokens and max_tokens is "
                f"{params.max_tokens}: no room is left for the prompt, even truncated",
                param="max_tokens",
            )
        head = keep // 2
        return prompt_token_ids[:head] + prompt_token_ids[n - (keep - head) :], n - keep
