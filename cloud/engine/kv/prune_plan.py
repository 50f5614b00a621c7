"""The block arithmetic of KV pruning (`--kv-prune-budget`; the tensor side is prune.py): which
prompts are pruned, how many tokens they keep, the blocks the trade takes, and what the engine
refuses. Torch-free: the scheduler and the admission checks (which a gateway runs in its own
process) use it.

- The kept count K is P - D * block_size, with D = ceil((P - budget) / block_size): at most the
  budget, and congruent to the prompt length P modulo the block size. A pruned request's `block_ids`
  are D entries of -1, then ceil(K / block_size) fresh blocks holding the kept tokens in order: so
  `block_ids[p // block_size]` finds position p's block for every token after the prompt, and kept
  token j sits where position D * block_size + j would. Its cache holds K + (tokens after the
  prompt); its RoPE positions go on from P (cached keys carry theirs already).
- The fresh blocks are taken while the prompt's are still held (the copy reads them), so at its
  peak a pruned request holds ceil(P / bs) + ceil(K / bs) blocks: a prompt whose peak exceeds the
  pool is refused up front (it could never be pruned), and one is admitted only while the pool has
  room for its peak (admitted earlier it would be preempted, and recompute, again and again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import ContextLengthExceededError, InvalidRequestError

if TYPE_CHECKING:
    from cloud.engine.config import EngineConfig

SINK_TOKENS = 4  # the first tokens, always kept (attention sinks, StreamingLLM's 4)
OBSERVATION_WINDOW = 32  # the prompt's last tokens: their queries score the rest; always kept
# max-pool width over the scores: a kept token keeps 10 neighbours each side. SnapKV pools over 7 for
# 7B models; SmolLM2-135M's question attends to the needle's words, not to the digits some tokens
# after them: on 1K-token needle cases pruned to 25%, kernel 7 kept 2 of dense's 9 right, 15 and 21
# all 9; at 10%, 15 kept 5 and 21 all 9 (at 2K: 21 kept dense's 7 at 25%, 6 at 10%)
POOL_KERNEL = 21


def min_budget(block_size: int) -> int:
    """The smallest budget pruning accepts: the sinks, the window and at least a block between."""
    return SINK_TOKENS + OBSERVATION_WINDOW + block_size


def check(config: EngineConfig, block_size: int, windowed: bool) -> None:
    """Refuse at engine start what pruning cannot serve correctly (windowed: the model has
    sliding-window layers), with the reason."""
    budget = config.kv_prune_budget
    if budget is None:
        return
    least = min_budget(block_size)
    why = None
    if budget < least:
        why = (
            f"is below {least}: the {SINK_TOKENS} sink tokens, the {OBSERVATION_WINDOW}-token observation "
            f"window and one {block_size}-token block"
        )
    elif config.kv_dtype != "auto":
        why = f"needs a full-precision KV cache (--kv-dtype auto), not {config.kv_dtype}"
    elif config.attention != "dense":
        why = "runs with dense attention only (--attention dense)"
    elif config.context_overflow == "sliding_window":
        why = "cannot run with --context-overflow sliding_window (both would drop the same blocks)"
    elif windowed:
        why = "cannot run a model with sliding-window layers (each layer would need its own selection)"
    if why is not None:
        raise InvalidRequestError(f"--kv-prune-budget {budget} {why}")


def prunes(num_prompt_tokens: int, budget: int | None) -> bool:
    """Whether a prompt of this length is pruned under this budget (None: pruning is off)."""
    return budget is not None and num_prompt_tokens > budget


def num_dropped_blocks(num_prompt_tokens: int, budget: int, block_size: int) -> int:
    """D: the leading block indices a pruned request gives up (-1 in its block_ids)."""
    return -(-(num_prompt_tokens - budget) // block_size)


def num_kept(num_prompt_tokens: int, budget: int, block_size: int) -> int:
    """K: the tokens a pruned prompt keeps, for every layer and KV head."""
    return num_prompt_tokens - num_dropped_blocks(num_prompt_tokens, budget, block_size) * block_size


@dataclass(frozen=True, slots=True)
class PruneLimit:
    """The prompts a pruning engine can take: those whose peak fits the pool (Admission asks)."""

    budget: int
    block_size: int
    num_blocks: int

    def peak_blocks(self, num_prompt_tokens: int) -> int:
        """The blocks a request holds while its prompt's KV is copied: the prompt's and the kept."""
        bs = self.block_size
        kept = num_kept(num_prompt_tokens, self.budget, bs)
        return -(-num_prompt_tokens // bs) + -(-kept // bs)

    def check(self, num_prompt_tokens: int) -> None:
        n = num_prompt_tokens
        if not prunes(n, self.budget) or self.peak_blocks(n) <= self.num_blocks:
            return
        raise ContextLengthExceededError(
            f"with --kv-prune-budget {self.budget}, a prompt of {n} tokens needs room for its KV and its "
            f"kept tokens' at once ({self.peak_blocks(n) * self.block_size} tokens); the KV cache holds "
            f"{self.num_blocks * self.block_size}"
        )


@dataclass(frozen=True, slots=True)
class PruneOrder:
    """The scheduler's word to the runner: copy the kept KV of a request's prompt (in `old_blocks`,
    still intact this step) into `new_blocks`, before the step's forward runs."""

    request_id: str
    old_blocks: list[int]  # the prompt's blocks, in position order (released by the scheduler)
    new_blocks: list[int]  # fresh: ceil(num_kept / block_size) of them
    num_prompt_tokens: int  # P
    num_kept: int  # K, for every layer and KV head
