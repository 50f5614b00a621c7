"""The types that cross the seam between the gateway and an engine, torch-free: what a request asks
for (SamplingParams, the prompt's image spans), what comes back for it (RequestOutput, each token's
SampleResult), and the engine's figures (EngineStats). The gateway, the fleet router and the engine
process's pipe all speak these; none of them needs torch, the model code or a grammar engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from shared.errors import ContextLengthExceededError, InvalidRequestError
from shared.grammar_spec import GrammarSpec

# how an embedding is pooled over its positions (cloud/engine/embedding.py)
Pooling = Literal["mean", "last"]


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
    # OpenAI's predicted output as token ids: what the output will likely be (an edited document):
    # drafted from by speculative decoding, it changes only how fast the output comes
    prediction: tuple[int, ...] = ()

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if self.temperature > 2:  # as OpenAI refuses it: sampling past 2 is noise
            raise InvalidRequestError(
                "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got "
                f"{self.temperature:g} instead.",
                param="temperature",
                code="decimal_above_max_value",
            )
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
        for param, ids in (
            ("logit_bias", list(self.logit_bias)),
            ("stop_token_ids", self.stop_token_ids),
            ("prediction", self.prediction),
        ):
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


def default_max_tokens(policy: str, max_model_len: int, num_prompt_tokens: int) -> int:
    """max_tokens for a request that sets none: what the prompt leaves of the context (as OpenAI).
    Under the `policy`s that take any prompt (truncate_middle, sliding_window) a prompt that leaves
    less than an eighth gets an eighth (its middle dropped to make room, or the window sliding on).
    drop_old_turns has already made that room where the chat had turns to drop (cloud/text/history.py):
    what is left is what the prompt leaves, as under error."""
    room = max_model_len - num_prompt_tokens
    if policy in ("truncate_middle", "sliding_window") and room < max_model_len // 8:
        return max(1, max_model_len // 8)
    return max(1, room)


def check_text_size(policy: str, max_model_len: int, num_chars: int, max_token_bytes: int | None) -> None:
    """Refuse, before tokenizing, a prompt whose text alone cannot fit the context: `num_chars`
    characters are at least as many bytes, so at least num_chars / max_token_bytes tokens (the
    tokenizer's bound; None: no bound, nothing refused). Only where overlong prompts are refused
    (`policy` error, and drop_old_turns, whose chat route counts only the text it cannot drop); the
    other policies take any length."""
    if max_token_bytes is None or policy not in ("error", "drop_old_turns"):
        return
    least = -(-num_chars // max_token_bytes)
    if least >= max_model_len:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt's "
            f"{num_chars} characters of text are at least {least} tokens"
        )


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


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the chosen token, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    constrained_logprob: float | None = None  # under the grammar-masked distribution, when asked
    rejected: bool = False  # the request's grammar refused the token: the request must end in error


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """Where a finished choice spent its time in the engine, in seconds: back to back from its arrival
    to its finish, so a reader that knows when the finish arrived can lay the phases out in time
    (durations, not clock readings: they mean the same in every process). A phase that never began
    is None: a choice aborted in the queue has no prefill, one that never sampled a token no decode."""

    queue_s: float  # arrival -> first admission (or -> finish, never admitted)
    prefill_s: float | None  # first admission -> first token (or -> finish, no token)
    decode_s: float | None  # first token -> finish


@dataclass(slots=True)
class RequestOutput:
    request_id: str  # the id the caller submitted (shared by its n > 1 choices)
    index: int  # which of the n choices
    text: str  # new text since the previous output of this choice
    token_ids: list[int]  # new tokens
    logprobs: list[SampleResult] = field(default_factory=list)  # one per new token, when asked
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_truncated_tokens: int = 0  # prompt tokens the engine dropped to fit the context (truncate_middle)
    # speculative decoding, the choice's totals so far: tokens drafted, and of those the model accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # with the first output, when asked: one entry per prompt token (the first has no logprob)
    prompt_logprobs: list[SampleResult] | None = None
    queue_time_s: float | None = None  # from arrival in the engine to first admission, once admitted
    phases: PhaseTimes | None = None  # on a choice's finished output only (traces, gateway/ops/tracing.py)
    error: str | None = None
    # why a choice that finished with "error" did, when the client caused it (e.g. grammar_dead_end);
    # None: the engine failed
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class TierStats:
    """One KV tier below the device pool (host RAM, disk: cloud/engine/kv/tiers), counts since start."""

    tier: str  # "host" / "disk"
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int  # blocks found here on a prefix lookup
    misses: int  # blocks looked up here and not found
    promotions: int  # blocks that went from here back to the device pool
    demotions: int  # blocks put here
    load_seconds: float  # reading blocks and copying them back
    write_errors: int = 0  # disk writes that failed (full, read-only): logged once per kind
    writes_dropped: int = 0  # disk writes dropped while the writer was behind
    corrupt: int = 0  # damaged files found (deleted, recomputed)
    dtype: str = ""  # what the tier stores, when colder than the pool's own ("int8", "int4"); "": the pool's


def sum_tiers(tiers: list[TierStats]) -> tuple[TierStats, ...]:
    """Several engines' tiers as one per tier name (what a gateway serving several models reports)."""
    out: dict[str, TierStats] = {}
    for t in tiers:
        o = out.get(t.tier)
        if o is None:
            out[t.tier] = t
            continue
        dtype = o.dtype if o.dtype == t.dtype else ",".join(sorted({o.dtype or "pool", t.dtype or "pool"}))
        summed = TierStats(t.tier, *(getattr(o, f) + getattr(t, f) for f in _TIER_SUMS))
        out[t.tier] = replace(summed, dtype=dtype)
    return tuple(out.values())


_TIER_SUMS = (
    "blocks", "bytes", "capacity_bytes", "hits", "misses", "promotions", "demotions", "load_seconds",
    "write_errors", "writes_dropped", "corrupt",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    kv_bytes_per_token: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0  # grammars compiled
    kv_tiers: tuple[TierStats, ...] = ()  # the KV tiers below the device pool, when configured
    spec_draft_tokens: int = 0  # speculative decoding since start: tokens drafted...
    spec_accepted_tokens: int = 0  # ...and accepted by the model
    kv_dtype: str = ""  # what the device pool's KV is stored as ("bfloat16", "int8", "fp8", ...)
