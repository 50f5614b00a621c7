"""The CPU sampler's fused last step (kernels/cpu/sampling.py) against the engine's PyTorch spelling,
cloud/engine/sampling/sampler.py: the same noise, the same chosen tokens."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.sampling.sampler import exponential_noise
from kernels.cpu import sampling

pytestmark = pytest.mark.skipif(not sampling.available(), reason="the C++ extension cannot be built here")


def _inputs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    steps = torch.randint(0, 5000, (rows,), generator=gen)
    return probs, seeds, steps


def test_the_noise_is_the_reference_noise() -> None:
    _, seeds, steps = _inputs(6, 10, 1)
    seeds[0], steps[0] = 0, 0
    seeds[1] = -1  # a negative seed wraps as the int64 arithmetic does
    want = exponential_noise(seeds, steps, 20000)
    got = sampling.exponential_noise(seeds, steps, 20000)
    differ = (got != want).sum().item()
    assert differ <= 2  # a double log's last bit, rarely left after rounding to float
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (7, 9000), (32, 1000), (3, 1)])
def test_picks_the_reference_tokens(rows: int, vocab: int) -> None:
    for seed in range(5):
        probs, seeds, steps = _inputs(rows, vocab, seed)
        want = torch.argmax(probs / exponential_noise(seeds, steps, vocab), dim=-1)
        assert torch.equal(sampling.noisy_argmax(probs, seeds, steps), want)


def test_ties_and_nan_follow_torch_argmax() -> None:
    probs = torch.zeros(2, 20000)
    seeds = torch.tensor([3, 4])
    steps = torch.tensor([0, 0])
    probs[1, 15000] = float("nan")
    probs[1, 17000] = float("nan")
    want = torch.argmax(probs / exponential_noise(seeds, steps, 20000), dim=-1)
    got = sampling.noisy_argmax(probs, seeds, steps)
    assert got.tolist() == want.tolist() == [0, 15000]


def test_strided_seed_views_and_empty_batches() -> None:
    probs, seeds, steps = _inputs(4, 300, 9)
    pairs = torch.stack([seeds, steps], dim=1)  # the sampler passes columns of one tensor
    want = torch.argmax(probs / exponential_noise(seeds, steps, 300), dim=-1)
    assert torch.equal(sampling.noisy_argmax(probs, pairs[:, 0], pairs[:, 1]), want)
    empty = sampling.noisy_argmax(
        torch.zeros(0, 300), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    )
    assert empty.shape == (0,)


@pytest.mark.parametrize(
    ("probs", "seeds", "match"),
    [
        (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), "float32"),
        (torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), r"int64 CPU tensors \[rows\]"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), r"int64 CPU tensors \[rows\]"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), "empty vocabulary"),
        (torch.zeros(5, 2).t(), torch.zeros(2, dtype=torch.long), "contiguous rows"),
    ],
)
def test_refuses_bad_input(probs: torch.Tensor, seeds: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampling.noisy_argmax(probs, seeds, torch.zeros_like(seeds))
