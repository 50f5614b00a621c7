"""The reduction pass of split-KV (flash-decoding) attention: each query head's context was cut into
S splits, each attended on its own; the splits' partial outputs are merged by their log-sum-exps.

    out = sum_s exp(lse_s - m) * o_s / sum_s exp(lse_s - m),   m = max_s lse_s

A split that saw no key has lse = -inf and weight 0. Grid: one program per (row, head); it reads
S * (d + 1) fp32 values and writes d outputs.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

H200_SMS = 132  # what split counts are sized for where torch sees no GPU (tests, the interpreter)


@cache
def _device_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once), by which split-KV kernels size their
    grids; an H200's count where torch sees no GPU."""
    if not torch.cuda.is_available():
        return H200_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _merge_splits_kernel(
    partial_out,  # [rows, heads, S, d] fp32
    partial_lse,  # [rows, heads, S] fp32
    out,  # [rows, heads, d]
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_or,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(partial_lse + row * stride_lr + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: the output is 0, not NaN
    w = tl.where(s_ok, tl.exp(lse - m), 0.0)  # [BLOCK_S]
    o = tl.load(
        partial_out + row * stride_pr + head * stride_ph + s[:, None] * stride_ps + dd[None, :],
        mask=s_ok[:, None] & (dd[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    acc = tl.sum(o * w[:, None], 0) / den
    tl.store(out + row * stride_or + head * stride_oh + dd, acc.to(out.dtype.element_ty), mask=dd < HEAD_DIM)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial_out: [rows, heads, S, d] fp32 (last dim contiguous); partial_lse: [rows, heads, S]
    fp32 (last dim contiguous); out: [rows, heads, d] (last dim contiguous), written and returned."""
    if partial_out.dim() != 4 or partial_lse.dim() != 3 or out.dim() != 3:
        raise ValueError("merge_splits wants partial_out [rows, heads, S, d], partial_lse [rows, heads, S]")
    rows, heads, splits, d = partial_out.shape
    if partial_lse.shape != (rows, heads, splits) or out.shape != (rows, heads, d):
        raise ValueError(
            f"shape mismatch: partial_out {tuple(partial_out.shape)}, "
            f"partial_lse {tuple(partial_lse.shape)}, out {tuple(out.shape)}"
        )
    if partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise ValueError("partial outputs and log-sum-exps must be float32")
    for name, t in (("partial_out", partial_out), ("partial_lse", partial_lse), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if not partial_out.device == partial_lse.device == out.device:
        raise ValueError("all tensors must be on one device")
    if rows == 0:
        return out
    _merge_splits_kernel[(rows, heads)](
        partial_out,
        partial_lse,
        out,
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        *out.stride()[:2],
        splits,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_S=max(triton.next_power_of_2(splits), 2),
    )
    return out


def merge_splits_reference(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """The same merge in PyTorch: [rows, heads, S, d], [rows, heads, S] -> [rows, heads, d] fp32."""
    m = partial_lse.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(partial_lse - m)  # [rows, heads, S]
    den = w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (partial_out * w.unsqueeze(-1)).sum(-2) / den
