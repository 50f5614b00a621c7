"""The elementwise hot spots of a Llama layer, each one pass over its rows: RMSNorm (with the
residual add folded in) and the rotary embedding of the query and key heads, in place.

    new_residual = x + residual                                   (rounded to residual's dtype)
    normed       = new_residual * rsqrt(mean(new_residual^2) + eps) * weight   (fp32, then x's dtype)
    rope:  out   = x * cos + cat(-x[d/2:], x[:d/2]) * sin        (NeoX half rotation)

All arithmetic is fp32 whatever the storage dtype, as the engine's `_norm` does; rope rounds once,
where PyTorch in bf16 rounds each product (so the two may differ by an ulp).

Grids: the norms run one program per row; it reads hidden elements of x (and of residual) plus the
weight, and writes hidden (twice with the residual). The rotation runs one program per token over
all its heads; it reads and writes heads * d elements of qk and reads d of cos and of sin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x,  # [T, hidden]
    residual,  # [T, hidden] (HAS_RESIDUAL only)
    weight,  # [hidden]
    out,  # [T, hidden], x's dtype
    residual_out,  # [T, hidden], residual's dtype (HAS_RESIDUAL only)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    h = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = h + tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        h_stored = h.to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * stride_ro + cols, h_stored, mask=ok)
        h = h_stored.to(tl.float32)  # the norm reads the residual as stored, as the engine does
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (h * rstd * w).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    qk,  # [T, heads, d], rotated in place
    cos,  # [T, d]
    sin,  # [T, d]
    stride_t,
    stride_h,
    stride_ct,
    stride_st,
    num_heads,
    HALF: tl.constexpr,  # d // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    jj = tl.arange(0, BLOCK_HALF)
    j_ok = jj < HALF
    c1 = tl.load(cos + tok * stride_ct + jj, mask=j_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + tok * stride_ct + HALF + jj, mask=j_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + tok * stride_st + jj, mask=j_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + tok * stride_st + HALF + jj, mask=j_ok, other=0.0).to(tl.float32)
    ok = (hh < num_heads)[:, None] & j_ok[None, :]
    first = qk + tok * stride_t + hh[:, None] * stride_h + jj[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c1[None, :] - x2 * s1[None, :]).to(qk.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(qk.dtype.element_ty), mask=ok)


def _check_rows(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be fp32/fp16/bf16, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def _warps(block: int) -> int:
    # about 8 elements a thread (one 16-byte load of 16-bit values), 1 to 16 warps
    return min(max(block // 256, 1), 16)


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_rows("x", x, 2)
    _check_rows("weight", weight, 1)
    tensors = [x, weight]
    if residual is not None:
        _check_rows("residual", residual, 2)
        tensors.append(residual)
        if residual.shape != x.shape:
            raise ValueError(f"shape mismatch: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = None if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    if rows == 0 or hidden == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if res_out is None else res_out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        0 if res_out is None else res_out.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] fp32/fp16/bf16 (last dim contiguous); weight: [hidden] (any float dtype, read
    as fp32) -> x * rsqrt(mean(x^2) + eps) * weight in x's dtype, computed in fp32."""
    normed, _ = _norm(x, None, weight, eps)
    return normed


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden] (any of fp32/fp16/bf16 each, last dims contiguous); weight: [hidden].
    -> (normed in x's dtype, new_residual = x + residual in residual's dtype), both new tensors; the
    norm reads new_residual as stored (rounded), as the engine's `_norm(h)` after `h = h + x` does."""
    normed, new_residual = _norm(x, residual, weight, eps)
    if new_residual is None:
        raise RuntimeError("the fused norm returned no residual")
    return normed, new_residual


def rope_apply_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate in place and return qk: [T, heads, d] fp32/fp16/bf16 (the q and k heads side by side;
    any strides with the last dim contiguous, e.g. a view into the fused qkv projection); cos, sin:
    [T, d] or [T, 1, d] (`RotaryEmbedding.tables`), both halves read as they are. d even."""
    _check_rows("qk", qk, 3)
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0]
        _check_rows(name, t, 2)
        tables.append(t)
    cos, sin = tables
    tokens, heads, d = qk.shape
    if d % 2 or cos.shape != (tokens, d) or sin.shape != (tokens, d):
        raise ValueError(
            f"rope_apply_ wants qk [T, heads, d] (d even), cos and sin [T, d]: got {tuple(qk.shape)}, "
            f"{tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if not qk.device == cos.device == sin.device:
        raise ValueError("all tensors must be on one device")
    if qk.numel() == 0:
        return qk
    block_h, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(d // 2)
    _rope_kernel[(tokens,)](
        qk,
        cos,
        sin,
        qk.stride(0),
        qk.stride(1),
        cos.stride(0),
        sin.stride(0),
        heads,
        HALF=d // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=_warps(2 * block_h * block_half),
    )
    return qk


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's `_norm` in PyTorch: fp32 math, the result in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    hf = new_residual.float()
    normed = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), new_residual


def rope_apply_reference(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`RotaryEmbedding.apply` in fp32, rounded once to qk's dtype (a new tensor). cos, sin: [T, d]."""
    x = qk.float()
    c, s = cos.float().reshape(qk.shape[0], 1, -1), sin.float().reshape(qk.shape[0], 1, -1)
    half = qk.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * c + rotated * s).to(qk.dtype)
