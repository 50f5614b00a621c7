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

from shared.engine_types import ImageSpan, SamplingParams

if TYPE_CHECKING:  # the grammar engine is imported only where grammars are compiled and applied
    from cloud.engine.speculative.ngram import NgramIndex
    from cloud.grammar.compiled import CompiledGrammar


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
    # KV pruning (kv/prune.py): its prompt's KV was compacted into fresh blocks after the prompt, -1
    # standing in block_ids for the blocks it gave up; its blocks are never entered in the prefix cache
    pruned: bool = False
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when it was first admitted (the end of its queueing)
    first_token_time: float | None = None  # when its first token was sampled (the end of its prefill)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of token_ids so far
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    window_from: int = 0  # first block whose companion (local layers' pages, kv/layout.py) it holds
    # speculative decoding: the lookup index of its tokens (built on its first draft), tokens drafted
    # for it and of those accepted
    lookup: NgramIndex | None = None
    predicted: NgramIndex | None = None  # the same of its predicted output (params.prediction)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_misses: int = 0  # verifying steps in a row that kept none of its drafts
    drafts_resume_at: int = 0  # drafting pauses until it has this many tokens (scheduler.BACK_OFF)
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
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None
