"""What a decoding request drafts in a step, and when it stops drafting for a while. The scheduler
decides whether a request may speculate at all this step (its batch, its kind of KV, its budget);
this module decides how many tokens and which.

- **How many**: at most `num_tokens`, and never the request's last token (the step's own sampled
  token may be it), nor past the context, nor past the step's budget.
- **Which**: from the request's predicted output (OpenAI's `prediction`) while the output follows it,
  else where the prediction holds the output's end; then, with `ngram`, prompt lookup over the
  request's own tokens (ngram.py).
- **Backing off**: after `BACK_OFF` verifying steps in a row that kept none of their drafts, a
  request stops drafting for 2**misses tokens (at most `MAX_PAUSE`): text its context does not
  predict costs it almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloud.engine.request import Request
from cloud.engine.speculative.ngram import NgramIndex

BACK_OFF = 2
MAX_PAUSE = 64


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding: drafts from a request's predicted output (`prediction`), and with `ngram`
    from its own context (prompt lookup, ngram.py)."""

    ngram: bool = True
    num_tokens: int = 3  # drafted per step at most
    min_n: int = 2  # the n-gram sizes looked up
    max_n: int = 4
    max_running: int = 4  # drafts only while at most this many requests run
    # a quantized cache rounds a block once its last slot is written: drafts never complete a block,
    # since a rejected one would leave the block's codes wrong
    within_block: bool = False


def draft_count(num_tokens: int, budget: int, tokens_left: int, context_left: int) -> int:
    """How many tokens a request may draft: `tokens_left` to its max_tokens, `context_left` to the
    context's end, `budget` this step (the step computes the drafts and the token before them)."""
    return min(num_tokens, budget - 1, tokens_left - 1, context_left)


def wants_drafts(req: Request, spec: SpecConfig | None) -> bool:
    """Whether the request has anything to draft from (the default path: nothing, every step)."""
    return spec is not None and (spec.ngram or bool(req.params.prediction))


def resting(req: Request) -> bool:
    """Backing off: its drafts kept failing, and the pause has not run out."""
    return req.num_tokens < req.drafts_resume_at


def propose(req: Request, spec: SpecConfig, k: int) -> list[int]:
    """Up to `k` tokens drafted for the request's next positions."""
    if req.params.prediction:
        drafts = _predicted(req, spec, k)
        if drafts or not spec.ngram:
            return drafts
    if not spec.ngram:
        return []
    if req.lookup is None:
        req.lookup = NgramIndex(spec.min_n, spec.max_n)
    return req.lookup.propose(req.token_ids, k)


def _predicted(req: Request, spec: SpecConfig, k: int) -> list[int]:
    """Drafts from the request's predicted output: its next tokens while the output has followed it
    from the start, else what follows the output's end where the prediction has it."""
    pred, out = req.params.prediction, req.output_token_ids
    if len(out) <= spec.max_n and tuple(out) == pred[: len(out)]:
        return list(pred[len(out) : len(out) + k])
    if req.predicted is None:
        req.predicted = NgramIndex(spec.min_n, spec.max_n)
    return req.predicted.find(pred, len(pred), req.token_ids, k)


def record(req: Request, drafted: int, accepted: int) -> None:
    """A verifying step's outcome: counted, and the back-off's state moved on (call it after the
    step's tokens were appended)."""
    req.num_draft_tokens += drafted
    req.num_accepted_tokens += accepted
    req.draft_misses = 0 if accepted else req.draft_misses + 1
    if req.draft_misses >= BACK_OFF:
        req.drafts_resume_at = req.num_tokens + min(2**req.draft_misses, MAX_PAUSE)
