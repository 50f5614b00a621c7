"""The CPU forward's small per-layer ops fused in C++ (norm_rope.cpp): RMSNorm, residual add +
RMSNorm, RoPE in place and SiLU(gate) * up, fp32 only. Same signatures and math as the Triton ones
(kernels/triton/norm_rope.py, whose *_reference functions are the references), except that
`fused_add_rms_norm` adds into `residual` in place (the forward owns that tensor) and `rope_apply_`
takes cos and sin as [T, d].

Built once per machine (build.py); `available()` is False where it cannot be built, and the model
keeps its PyTorch spelling. Tests: tests/kernels/test_cpu_norm_rope.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import Extension

_SOURCE = Path(__file__).with_name("norm_rope.cpp")


_EXT = Extension("norm_rope", _SOURCE)


def available() -> bool:
    """Whether the compiled kernels load here (the first call builds them)."""
    return _EXT.available()


_module = _EXT.module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] fp32, rows contiguous; weight: [hidden] fp32 -> a new [T, hidden]."""
    out: torch.Tensor = _module().rms_norm(x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place; returns (rms_norm(residual) * weight, residual)."""
    normed, new_residual = _module().add_rms_norm_(x, residual, weight, eps)
    return normed, new_residual


def rope_apply_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [T, heads, d] (rows contiguous, any other strides) in place; cos, sin: [T, d]."""
    out: torch.Tensor = _module().rope_(qk, cos, sin)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate then up) -> silu(gate) * up, a new [T, I]."""
    out: torch.Tensor = _module().silu_mul(gate_up)
    return out
