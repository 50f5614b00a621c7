"""A request's state: its tokens and one progress counter.

Invariant (ARCHITECTURE.md): `num_computed_tokens` counts the leading tokens of `token_ids` whose
KV is in the request's blocks. Prefill, chunked prefill, a prefix-cache hit and a resume after
preemption all just advance it until it equals len(token_ids); then the next token is sampled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cloud.grammar.spec import GrammarSpec  # plain data (the engine process decodes it off the wire)
from shared.errors import InvalidRequestError

if TYPE_CHECKING:  # the grammar engine is imported only where grammars are compiled and applied
    from cloud.grammar.compiled import CompiledGrammar


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, over prompt and output (HF semantics)
    presence_penalty: float = 0.0  # additive, over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings; the stop text is not returned
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    prompt_logprobs: int | None = None  # the same for every prompt token (computes the whole prompt)
    n: int = 1
    grammar: GrammarSpec | None = None  # the output must follow this grammar (JSON schema, tool calls)
    # also report each chosen token's logprob under the grammar-masked distribution
    constrained_logprobs: bool = False
    # partitions the prefix cache: cached blocks are reused only by requests with the same salt (the
    # gateway sets the caller's tenant, so one tenant's hits never reveal another's prompts)
    cache_salt: str | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "logprobs",
                "must be in [0, 20]",
            ),
            (1 <= self.n <= 16, "n", "must be in [1, 16]"),
            (len(self.stop) <= 16 and all(self.stop), "stop", "at most 16 non-empty strings"),
        ]
        for ok, param, why in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {why}", param=param)
        for param, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", self.stop_token_ids)):
            if any(not 0 <= tid < vocab_size for tid in ids):
                raise InvalidRequestError(f"{param} names a token id outside the vocabulary", param=param)
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
        if self.grammar is not None and self.ignore_eos:
            # the grammar allows only the end-of-turn token once it is complete: nothing could follow
            raise InvalidRequestError(
                "ignore_eos cannot be combined with structured output", param="ignore_eos"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Prompt tokens [start, end) that stand for one image; its content hash enters the hash of every
    block they touch, so equal text from different images never shares KV blocks."""

    start: int
    end: int
    digest: bytes  # the image's sha256


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    token_ids: list[int]
    image_spans: tuple[ImageSpan, ...] = ()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or asked
    ERROR = "error"  # the engine failed on this request


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first; FCFS within a priority
    extra_key: bytes = b""  # mixed into every block hash (adapter, ...)
    image_spans: tuple[ImageSpan, ...] = ()  # mixed into the hashes of the blocks they touch
    arrival_time: float = field(default_factory=time.monotonic)
    # Start only once this request (an n > 1 sibling) has its prompt cached: then it reuses those blocks.
    wait_for: Request | None = None
    grammar: CompiledGrammar | None = None  # compiled from params.grammar; its matcher lives in the sampler

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    num_truncated_tokens: int = 0  # prompt tokens dropped by the truncate_middle overflow policy
    # sliding_window policy, for a request longer than the context: keep the sink blocks and a ring
    # of recent blocks; dropped blocks leave -1 in block_ids, so indices stay positions // block_size
    sliding: bool = False
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when it was first admitted (the end of its queueing)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of token_ids so far
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt then output, kept in step

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return why the request is now finished, if it is."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None
