"""The sampler's last step on the CPU (sampling.cpp): per row, argmax of probs / the seeded Exp(1)
noise of cloud/engine/sampler.py `exponential_noise` (the reference), in one pass without
materializing the noise. Same arithmetic; see the C++ file for the one last-bit caveat.

Built once per machine (build.py); `available()` is False where it cannot be built, and the sampler
keeps its PyTorch spelling. Tests: tests/kernels/test_cpu_sampling.py.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from .build import load_extension

_SOURCE = Path(__file__).with_name("sampling.cpp")


@cache
def _ext() -> ModuleType | None:
    return load_extension("sampling", _SOURCE)


def available() -> bool:
    """Whether the compiled op loads here (the first call builds it)."""
    return _ext() is not None


def _module() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("the CPU sampling extension could not be built (see the warning)")
    return ext


def noisy_argmax(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] fp32 (rows contiguous); seeds, steps [rows] int64 -> [rows] int64:
    argmax(probs / exponential_noise(seeds, steps, vocab), dim=-1)."""
    out: torch.Tensor = _module().noisy_argmax(probs, seeds, steps)
    return out


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise itself, [rows, vocab] fp32, as the C++ computes it (for tests)."""
    out: torch.Tensor = _module().exponential_noise(seeds, steps, vocab)
    return out
