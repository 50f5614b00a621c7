"""Where the engine runs: `--device auto|cpu|cuda[:N]`, resolved once at start.

`auto` takes the first CUDA GPU when torch sees one, else the CPU. The run dtype follows the device
when left on `auto`: bfloat16 on a GPU (tensor cores; the greedy agreement with the float32
reference is measured by the GPU check, docs/benchmarks.md), float32 on a CPU (bf16 is fast only
with AMX, and our CPUs range from AVX2-only to AMX: a default must not depend on it).
"""

from __future__ import annotations

import re

import torch

from shared.errors import InvalidRequestError

_SPEC = re.compile(r"^(auto|cpu|cuda(?::(\d+))?)$")


def resolve_device(spec: str) -> torch.device:
    """The torch device for a `--device` value; refuses what this machine cannot honour."""
    m = _SPEC.match(spec)
    if m is None:
        raise InvalidRequestError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        raise InvalidRequestError(f"--device {spec}: torch sees no CUDA GPU on this machine")
    index = int(m.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidRequestError(f"--device {spec}: this machine has {count} CUDA GPU(s)")
    return torch.device("cuda", index)


def default_dtype(device: torch.device) -> str:
    """The run dtype `--dtype auto` means on this device."""
    return "bfloat16" if device.type == "cuda" else "float32"
