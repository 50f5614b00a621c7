"""The CPU forward's small per-layer ops fused in C++ (norm_rope.cpp): RMSNorm, residual add +
RMSNorm, RoPE in place and SiLU(gate) * up, fp32 only. Same signatures and math as the Triton ones
(kernels/triton/norm_rope.py, whose *_reference functions are the references), except that
`fused_add_rms_norm` adds into `residual` in place (the forward owns that tensor) and `rope_apply_`
takes cos and sin as [T, d].

Built once per machine (build.py); `available()` is False where it cannot be built, and the model
keeps its PyTorch spelling. The row loops are vectorized for AVX2 and AVX-512, chosen at run time
(`CTXFUSE_CPU_ISA` caps the choice; `set_isa` for tests). Tests: tests/kernels/test_cpu_norm_rope.py.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from .build import ISAS, Extension, isa_cap

_SOURCE = Path(__file__).with_name("norm_rope.cpp")


def _apply_isa_cap(ext: ModuleType) -> None:
    cap = isa_cap()  # CTXFUSE_CPU_ISA: the widest path allowed (levels 1..3 are ISAS' order)
    if cap is not None:
        ext.set_isa(min(ISAS.index(cap) + 1, ext.best_isa()))


_EXT = Extension("norm_rope", _SOURCE, on_load=_apply_isa_cap)


def available() -> bool:
    """Whether the compiled kernels load here (the first call builds them)."""
    return _EXT.available()


_module = _EXT.module


def isa() -> str:
    """The vector path the kernels take: scalar, avx2 or avx512."""
    return ISAS[int(_module().isa()) - 1]


def set_isa(name: str) -> None:
    """Take a narrower vector path than the widest (tests, benchmarks); ValueError where this CPU
    has not got it."""
    _module().set_isa(ISAS.index(name) + 1)


def supported_isas() -> list[str]:
    """The vector paths this CPU runs, widest first."""
    return list(reversed(ISAS[: int(_module().best_isa())]))


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
