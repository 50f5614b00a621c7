"""Turns next-token logits into tokens, per request: logit bias, penalties, greedy or temperature
sampling with top-k / top-p / min-p, and logprobs.

A request with a grammar has its forbidden tokens masked (-inf) for the whole batch at once before
any rule runs, so greedy, sampling and penalties all choose among allowed tokens only.

Reproducibility: each request owns a torch.Generator (seeded from its `seed`, else at random) that
is consumed once per sampled token, so a seeded request samples the same tokens whatever else
shares its batch. Logprobs are those of the model's own distribution (before penalties and
temperature), as vLLM reports by default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .grammar_mask import GrammarMasks
from .request import Request, SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the chosen token, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    constrained_logprob: float | None = None  # under the grammar-masked distribution, when asked
    rejected: bool = False  # the request's grammar refused the token: the request must end in error


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMasks()

    @staticmethod
    def score(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[SampleResult]:
        return score(logits, targets, tops)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.grammars.forget(request_id)

    def _generator(self, req: Request) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(req.params.seed if req.params.seed is not None else random.getrandbits(63))
            self._generators[req.request_id] = g
        return g

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        # logits: [requests, vocab] fp32
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits, rows = self.grammars.apply(logits, requests)
        constrained = set(rows)
        # plain greedy rows (the common case in batches) take one batched argmax
        plain = [i for i, r in enumerate(requests) if r.params.greedy and not _needs_penalties(r.params)]
        fast = dict(zip(plain, logits[plain].argmax(dim=-1).tolist(), strict=True)) if plain else {}
        results = []
        for row, req in enumerate(requests):
            token = fast.get(row)
            if token is None:
                token = _choose(_apply_penalties(logits[row], req), req.params, self._generator(req))
            res = SampleResult(token)
            if raw_logprobs is not None and req.params.logprobs is not None:
                lp = raw_logprobs[row]
                res.logprob = float(lp[token])
                res.top_logprobs = _top(lp, req.params.logprobs)
            if row in constrained:
                if req.params.constrained_logprobs:
                    res.constrained_logprob = float(torch.log_softmax(logits[row], dim=-1)[token])
                res.rejected = not self.grammars.accept(req, token)
            results.append(res)
        return results


def score(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[SampleResult]:
    """Logprobs of given tokens under the model's distribution (prompt logprobs), with top k each."""
    lps = torch.log_softmax(logits, dim=-1)
    chosen = lps[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)].tolist()
    return [
        SampleResult(t, c, _top(lps[i], k))
        for i, (t, c, k) in enumerate(zip(targets, chosen, tops, strict=True))
    ]


def _top(lp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    vals, ids = torch.topk(lp, k)
    return list(zip(ids.tolist(), vals.tolist(), strict=True))


def _needs_penalties(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)


def _apply_penalties(x: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    if not _needs_penalties(p):
        return x
    x = x.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype)
    if p.repetition_penalty != 1.0 and req.token_ids:
        seen = torch.unique(torch.tensor(req.token_ids, dtype=torch.long))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=x.shape[0])
        x -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def _choose(x: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """x: [vocab] processed logits -> the chosen token id."""
    if p.greedy:
        return int(torch.argmax(x))
    x = x / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays)
        drop = (cum - sorted_p) >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per token
    e = torch.empty_like(probs).exponential_(generator=g)
    return int(torch.argmax(probs / e))
