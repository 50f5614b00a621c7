"""The batched sampler: counter-based noise (reproducible per request whatever shares its batch),
the top-k / top-p / min-p filters and the penalties as batch tensor operations, each against a
per-row reference written the plain way."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.sampling.sampler import (
    Sampler,
    SampleRow,
    SamplingBatch,
    _filtered_probs,
    apply_penalties,
    exponential_noise,
)
from shared.engine_types import SamplingParams


def _row(rid: str, tokens: list[int] | None = None, prompt: int = 0, **params: object) -> SampleRow:
    return SampleRow(rid, SamplingParams(**params), None, list(tokens or []), prompt)  # type: ignore[arg-type]


def test_noise_is_a_function_of_seed_step_and_token_alone() -> None:
    alone = exponential_noise(torch.tensor([5]), torch.tensor([9]), 1000)
    batch = exponential_noise(torch.tensor([3, 5, 7]), torch.tensor([0, 9, 2]), 1000)
    assert torch.equal(alone[0], batch[1])
    later = exponential_noise(torch.tensor([5]), torch.tensor([10]), 1000)
    assert not torch.equal(alone, later)
    # Exp(1): mean 1, P(E > 1) = 1/e, over 49,152 draws of one fixed seed
    big = exponential_noise(torch.tensor([123]), torch.tensor([0]), 49152)[0].double()
    assert big.min() > 0
    assert abs(float(big.mean()) - 1.0) < 0.02
    assert abs(float((big > 1).double().mean()) - 0.3679) < 0.01


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [_row(f"r{i}", [1, 2], 1, temperature=1.0, seed=40 + i) for i in range(3)]
    together = Sampler()(logits, SamplingBatch.of(rows))
    alone = Sampler()(logits[1:2], SamplingBatch.of(rows[1:2]))
    assert together[1].token_id == alone[0].token_id


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    rows = [_row(f"r{i}", [0] * (i % 7), 0, temperature=1.0, seed=i) for i in range(4000)]
    tokens = [r.token_id for r in Sampler()(logits, SamplingBatch.of(rows))]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / len(tokens)
    assert torch.allclose(freq, probs.double(), atol=0.03)


def _filter_reference(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The plain per-row filters: temperature, top-k on logits, min-p and top-p on probabilities."""
    x = x / p.temperature
    if p.top_k > 0:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    return probs


def test_filters_over_the_batch_equal_the_per_row_reference() -> None:
    g = torch.Generator().manual_seed(1)
    settings = [
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.5, "min_p": 0.02},
        {"temperature": 1.0},
    ]
    rows = [_row(f"r{i}", seed=i, **s) for i, s in enumerate(settings)]
    x = torch.randn(len(rows), 64, generator=g) * 3
    batch = SamplingBatch.of(rows)
    idx = torch.arange(len(rows))
    got = _filtered_probs(x, batch, idx, [r.params for r in rows])
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], _filter_reference(x[i], r.params))


def _penalties_reference(x: torch.Tensor, row: SampleRow) -> torch.Tensor:
    p = row.params
    x = x.clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(row.token_ids, dtype=torch.long))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    out = row.output_token_ids
    if out:
        counts = torch.bincount(torch.tensor(out), minlength=x.shape[0]).float()
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return x


@pytest.mark.parametrize("vocab", [32, 100])
def test_penalties_over_the_batch_equal_the_per_row_reference(vocab: int) -> None:
    rows = [
        _row("a", [1, 2, 2, 3, 3, 3], 2, frequency_penalty=0.5, presence_penalty=0.25),
        _row("plain", [4, 5], 1),
        _row("b", [7, 7, 8], 1, repetition_penalty=1.3, logit_bias={3: 2.0, 9: -5.0}),
        _row("c", [], 0, repetition_penalty=0.8),
    ]
    x = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(vocab))
    got = apply_penalties(x, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], _penalties_reference(x[i], r))
