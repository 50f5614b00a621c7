"""Input checks the sparse kernels share (quest_select.py, sparse_decode.py, and the CPU's
kernels/cpu/quest_select.py): each names the argument it refuses, with a ValueError. Torch only: the
CPU kernels import it without Triton."""

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


def check_select(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sink_blocks: int,
    window_blocks: int,
    top_k: int,
    block_size: int,
) -> None:
    """A Quest selection's arguments (kernels/triton/quest_select.py's docstring)."""
    check_float("q", q, 3)
    check_float("kmin", kmin, 3)
    check_float("kmax", kmax, 3)
    if kmin.shape != kmax.shape:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} differ in shape")
    check_heads(q, kmin.shape[0], kmin.shape[2])
    check_index("block_tables", block_tables, (q.shape[0], -1))
    check_index("context_lens", context_lens, (q.shape[0],))
    for name, value in (("sink_blocks", sink_blocks), ("window_blocks", window_blocks), ("top_k", top_k)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_device(q=q, kmin=kmin, kmax=kmax, block_tables=block_tables, context_lens=context_lens)
