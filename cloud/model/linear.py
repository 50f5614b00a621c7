"""Weight formats for the model's projections: dense (float32 / bfloat16 / float16) or weight-only
int8 / int4, each behind one call `linear(x) -> y` so the forward does not know which it runs.

Why these kernels: decode is bound by reading weights. On CPU, PyTorch's int4 weight-only kernel
(`_weight_int4pack_mm_for_cpu`, bf16 activations, group-wise scale and zero) reads a quarter of the
fp32 bytes; `_weight_int8pack_mm` (per-channel scales) is the int8 path.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

WeightQuant = Literal["none", "int8", "int4"]
WEIGHT_QUANTS: tuple[WeightQuant, ...] = ("none", "int8", "int4")
INT4_GROUP = 32  # the GGUF Q4 block size, so Q4_0 / Q4_1 weights keep their own grouping


class Linear:
    """y = x @ W.T (+ b). `x` and `y` are in the model's run dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: WeightQuant):
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.quant: WeightQuant = quant
        self.bias = None if bias is None else bias.to(dtype)
        if quant == "int4" and self.in_features % INT4_GROUP:
            self.quant = "int8"  # no whole groups: fall back to per-channel int8
        if self.quant == "none":
            self.weight = weight.to(dtype).contiguous()
        elif self.quant == "int8":
            self.weight, self.scales = _quantize_int8(weight)
        else:
            self.weight, self.scales_zeros = _quantize_int4(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, in_features] -> [tokens, out_features]
        if self.quant == "none":
            return F.linear(x, self.weight, self.bias)
        if self.quant == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.weight, INT4_GROUP, self.scales_zeros
            )
        y = y.to(self.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight this layer effectively multiplies by, in fp32 (for tests and accuracy reports)."""
        if self.quant == "none":
            return self.weight.float()
        if self.quant == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        q = _unpack_int4_reference(self.weight, self.out_features, self.in_features)
        sz = self.scales_zeros.float()  # [groups, out, 2]
        scale = sz[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)
        zero = sz[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
        return (q - 8) * scale + zero

    @property
    def nbytes(self) -> int:
        extra = 0
        if self.quant == "int8":
            extra = self.scales.numel() * self.scales.element_size()
        elif self.quant == "int4":
            extra = self.scales_zeros.numel() * self.scales_zeros.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~= q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    # _weight_int8pack_mm wants scales in the activation dtype; bf16 activations halve the traffic
    return q, scale.to(torch.bfloat16)


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group of 32 inputs): w ~= (q - 8) * scale + zero.

    For weights that came from GGUF Q4_1 (w = d*q + m over blocks of 32) the same q is recovered,
    so only the bf16 rounding of scale and zero separates this from the file's own values.
    """
    w = w.float()
    out, inp = w.shape
    g = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out, inp)
    zero = lo + 8.0 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def _unpack_int4_reference(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """Recover q (0..15) from the packed layout by multiplying with the identity (slow; tests only)."""
    eye = torch.eye(inp, dtype=torch.bfloat16)
    groups = inp // INT4_GROUP
    ones = torch.stack([torch.ones(groups, out), torch.zeros(groups, out)], dim=-1).to(torch.bfloat16)
    # with scale 1 and zero 0 the kernel yields (q - 8); columns of the identity pick each input
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUP, ones.contiguous())
    return y.float().t() + 8
