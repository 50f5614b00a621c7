"""Input checks the Triton sparse kernels share (quest_select.py, sparse_decode.py): each names the
argument it refuses, with a ValueError."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_float(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.shape[-1] > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in INTS:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want >= 0 and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        want_s = ", ".join("*" if w < 0 else str(w) for w in shape)
        raise ValueError(f"{name} must have shape [{want_s}], got {tuple(t.shape)}")


def check_heads(q: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    heads, d = q.shape[1], q.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a whole number of groups of {kv_heads} KV heads")
    if d != head_dim or d < 1:
        raise ValueError(f"head dim mismatch: q has {d}, the cache {head_dim}")


def check_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in tensors.items())
        raise ValueError(f"all tensors must be on one device: {where}")
