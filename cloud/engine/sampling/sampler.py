"""Turns next-token logits into tokens for a whole batch at once: logit bias, penalties, grammar
masks, greedy or temperature sampling with top-k / top-p / min-p, and logprobs.

Every rule is a tensor operation over the batch's rows (the sampling parameters live as tensors in
the runner's input batch); Python loops only build the results handed back, and the token lists
that penalties count.

A request with a grammar has its forbidden tokens masked (-inf) before any rule runs, so greedy,
sampling and penalties all choose among allowed tokens only.

Reproducibility: sampling is an exponential race, argmax(p / E) with E ~ Exp(1), which draws from
p. E comes from a counter-based generator: a 64-bit hash of (the request's seed, how many tokens it
has generated, the token id). So a seeded request samples the same tokens whatever else shares its
batch, on any device, with no generator object per request and no loop over rows. Logprobs are
those of the model's own distribution (before penalties and temperature), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cloud.engine.sampling.grammar_mask import GrammarMasks
from kernels.cpu.sampling import available as cpu_sampling_available
from kernels.cpu.sampling import noisy_argmax
from shared.engine_types import SampleResult, SamplingParams

if TYPE_CHECKING:
    from cloud.grammar.compiled import CompiledGrammar


@dataclass(slots=True)
class SampleRow:
    """One request as the sampler sees it (the runner's input batch keeps these across steps)."""

    request_id: str
    params: SamplingParams
    grammar: CompiledGrammar | None
    token_ids: list[int]  # prompt, then every token generated so far
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class SamplingBatch:
    """The rows to sample this step and their parameters as tensors on the logits' device."""

    rows: list[SampleRow]
    temperature: torch.Tensor  # [r] fp32, 0: greedy
    top_k: torch.Tensor  # [r] int64, 0: off
    top_p: torch.Tensor  # [r] fp32, 1: off
    min_p: torch.Tensor  # [r] fp32, 0: off
    seeds: torch.Tensor  # [r] int64
    steps: torch.Tensor  # [r] int64: tokens each request has generated (the noise counter)

    @classmethod
    def of(cls, rows: list[SampleRow], device: torch.device | str = "cpu") -> SamplingBatch:
        """A batch built from the rows' parameters (the runner keeps these tensors persistent)."""
        values = [param_row(r.params) for r in rows]
        floats = torch.tensor([v[0] for v in values], dtype=torch.float32).view(-1, 3)
        ints = torch.tensor([v[1] for v in values], dtype=torch.long).view(-1, 2)
        steps = torch.tensor([len(r.token_ids) - r.num_prompt_tokens for r in rows], dtype=torch.long)
        floats, ints, steps = floats.to(device), ints.to(device), steps.to(device)
        return cls(rows, floats[:, 0], ints[:, 0], floats[:, 1], floats[:, 2], ints[:, 1], steps)


def param_row(p: SamplingParams) -> tuple[tuple[float, float, float], tuple[int, int]]:
    """A request's sampling parameters as tensor rows: (temperature, top_p, min_p), (top_k, seed)."""
    top_k = p.top_k if p.top_k > 0 else 0
    return (p.temperature, p.top_p, p.min_p), (top_k, p.seed if p.seed is not None else 0)


class Sampler:
    def __init__(self, device: torch.device | None = None) -> None:
        self.grammars = GrammarMasks()
        if device is not None and device.type == "cpu":
            cpu_sampling_available()  # built (once per machine) now, not on the first sampled step

    @staticmethod
    def score(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[SampleResult]:
        return score(logits, targets, tops)

    def forget(self, request_id: str) -> None:
        self.grammars.forget(request_id)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        # logits: [rows, vocab] fp32
        rows = batch.rows
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None
        logits, constrained = self.grammars.apply(logits, rows)
        logits = apply_penalties(logits, rows)
        tokens = choose(logits, batch)
        token_list = tokens.tolist()  # the step's one device-to-host sync
        results = [SampleResult(t) for t in token_list]
        if raw_logprobs is not None:
            k = max(rows[i].params.logprobs or 0 for i in want_logprobs)
            chosen = raw_logprobs.gather(1, tokens[want_logprobs].unsqueeze(1)).squeeze(1).tolist()
            tops = raw_logprobs.topk(k, dim=-1) if k else None
            top_ids = tops.indices.tolist() if tops is not None else []
            top_vals = tops.values.tolist() if tops is not None else []
            for j, i in enumerate(want_logprobs):
                n = rows[i].params.logprobs or 0
                results[i].logprob = chosen[j]
                results[i].top_logprobs = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else []
        wanted = [i for i in constrained if rows[i].params.constrained_logprobs]
        if wanted:
            lps = torch.log_softmax(logits[wanted], dim=-1).gather(1, tokens[wanted].unsqueeze(1))
            for i, lp in zip(wanted, lps.squeeze(1).tolist(), strict=True):
                results[i].constrained_logprob = lp
        for i in constrained:
            results[i].rejected = not self.grammars.accept(rows[i], token_list[i])
        return results


def score(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[SampleResult]:
    """Logprobs of given tokens under the model's distribution (prompt logprobs), with top k each."""
    lps = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen = lps[torch.arange(len(targets), device=logits.device), index].tolist()
    return [
        SampleResult(t, c, _top(lps[i], k))
        for i, (t, c, k) in enumerate(zip(targets, chosen, tops, strict=True))
    ]


def _top(lp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    vals, ids = torch.topk(lp, k)
    return list(zip(ids.tolist(), vals.tolist(), strict=True))


def needs_penalties(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Logit bias, repetition (HF: over prompt and output), presence and frequency (OpenAI: over
    output) penalties for the rows that ask for any, as batched scatters."""
    which = [i for i, r in enumerate(rows) if needs_penalties(r.params)]
    if not which:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    picked = [rows[i] for i in which]
    index = torch.tensor(which, dtype=torch.long, device=dev)
    x = logits[index].clone()  # [p, vocab]
    bias = [(j, t, b) for j, r in enumerate(picked) for t, b in r.params.logit_bias.items()]
    if bias:
        at = torch.tensor([(j, t) for j, t, _ in bias], dtype=torch.long, device=dev)
        x.index_put_((at[:, 0], at[:, 1]), torch.tensor([b for *_, b in bias], device=dev), accumulate=True)
    rep = torch.tensor([r.params.repetition_penalty for r in picked], device=dev).unsqueeze(1)
    seen = _counts([r.token_ids for r in picked], vocab, dev) > 0
    x = torch.where(seen & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
    counts = _counts([r.output_token_ids for r in picked], vocab, dev)
    freq = torch.tensor([r.params.frequency_penalty for r in picked], device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in picked], device=dev).unsqueeze(1)
    x = x - freq * counts - pres * (counts > 0).float()
    out = logits.clone()
    out[index] = x
    return out


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: [lists, vocab] fp32, from one padded scatter."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # pad: a spare column
        for i, t in enumerate(token_lists):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def choose(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """x: [rows, vocab] processed logits -> [rows] chosen token ids (on x's device)."""
    greedy = x.argmax(dim=-1)
    sampled = [i for i, r in enumerate(batch.rows) if not r.params.greedy]
    if not sampled:
        return greedy
    idx = torch.tensor(sampled, dtype=torch.long, device=x.device)
    probs = _filtered_probs(x[idx], batch, idx, [batch.rows[i].params for i in sampled])
    seeds, steps = batch.seeds[idx], batch.steps[idx]
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and cpu_sampling_available():
        picked = noisy_argmax(probs, seeds, steps)  # one pass, the noise never materialized
    else:
        picked = torch.argmax(probs / exponential_noise(seeds, steps, x.shape[-1]), dim=-1)
    return greedy.index_copy(0, idx, picked)


def _filtered_probs(
    x: torch.Tensor, batch: SamplingBatch, idx: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """Temperature, then top-k on logits, then min-p and top-p on probabilities; rows whose rule is
    off are untouched by it. x: [s, vocab] -> probabilities [s, vocab]."""
    x = x / batch.temperature[idx].unsqueeze(1)
    if any(p.top_k > 0 for p in params):
        k = batch.top_k[idx]  # [s], 0: off
        kmax = int(max(p.top_k for p in params))
        kth = x.topk(min(kmax, x.shape[-1]), dim=-1).values  # [s, kmax] best first
        bound = kth.gather(1, (k.clamp(1, kth.shape[-1]) - 1).unsqueeze(1))
        x = x.masked_fill((k > 0).unsqueeze(1) & (x < bound), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = batch.min_p[idx].unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        top_p = batch.top_p[idx].unsqueeze(1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays)
        drop = (before >= top_p) & (top_p < 1.0)
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    return probs


_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_STEP_KEY = _signed(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab], a pure function of (seed, step, token id): splitmix64's finalizer
    over a key that mixes the three (int64 arithmetic wraps), 53 bits to a uniform in (0, 1)."""
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    key = (seeds * _GOLDEN + steps * _STEP_KEY).unsqueeze(1) + tokens * _GOLDEN  # [rows, vocab]
    z = (key ^ _shr(key, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 11).double() + 0.5) * (1.0 / (1 << 53))
    return -torch.log(u).float()
