"""The sampler's last step on the CPU (sampling.cpp): per row, argmax of probs / the seeded Exp(1)
noise of cloud/engine/sampling/sampler.py `exponential_noise` (the reference), in one pass without
materializing the noise. Same arithmetic; see the C++ file for the one last-bit caveat.

Built once per machine (build.py); `available()` is False where it cannot be built, and the sampler
keeps its PyTorch spelling. Tests: tests/kernels/test_cpu_sampling.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import Extension

_SOURCE = Path(__file__).with_name("sampling.cpp")


_EXT = Extension("sampling", _SOURCE)


def available() -> bool:
    """Whether the compiled kernels load here (the first call builds them)."""
    return _EXT.available()


_module = _EXT.module


def noisy_argmax(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] fp32 (rows contiguous); seeds, steps [rows] int64 -> [rows] int64:
    argmax(probs / exponential_noise(seeds, steps, vocab), dim=-1)."""
    out: torch.Tensor = _module().noisy_argmax(probs, seeds, steps)
    return out


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise itself, [rows, vocab] fp32, as the C++ computes it (for tests)."""
    out: torch.Tensor = _module().exponential_noise(seeds, steps, vocab)
    return out
