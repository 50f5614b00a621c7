"""Group-wise asymmetric quantization of KV blocks, as KIVI lays it out.

Keys vary most across channels (a few outlier channels), so a key group is one channel of one
block: its min and max over the block's tokens. Values vary most across tokens, so a value group
is one token's head vector. Codes are unsigned: x ~ code * scale + zero, with fp16 scale and zero
(for keys the zero is the block's channel minimum and the scale follows from the maximum, so the
key parameters double as the block's min/max summary for sparse attention). int4 packs two codes
per byte: the even channel in the low nibble, the odd one in the high nibble.

Error bound: |x - dequant(quant(x))| <= scale / 2, plus the fp16 rounding of scale and zero.
"""

from __future__ import annotations

import torch

BITS = {"int8": 8, "int4": 4}


def levels(bits: int) -> int:
    return (1 << bits) - 1


def code_width(head_dim: int, bits: int) -> int:
    """Bytes one token's head vector takes as codes."""
    return head_dim if bits == 8 else head_dim // 2


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., d] uint8 in [0, 2**bits) -> [..., code_width] uint8."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _quantize(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    q = torch.round((x.float() - zero.float()) / scale.float())
    return q.clamp_(0, levels(bits)).to(torch.uint8)


def key_scale(kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """The step between key codes from a block's fp16 channel min / max; a flat channel gets 1 (code 0)."""
    scale = (kmax.float() - kmin.float()) / levels(bits)
    return torch.where(scale > 0, scale, torch.ones_like(scale)).half()


def quantize_keys(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """k: [h, n, bs, d] whole blocks; kmin / kmax: [h, n, d] fp16 per channel -> codes [h, n, bs, w]."""
    zero = kmin.unsqueeze(2)
    scale = key_scale(kmin, kmax, bits).unsqueeze(2)
    return pack(_quantize(k, zero, scale, bits), bits)


def quantize_values(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v: [..., d] -> packed codes [..., w], fp16 scale [...], fp16 zero [...] (one group per token)."""
    vf = v.float()
    lo, hi = vf.amin(-1), vf.amax(-1)
    zero = lo.half()
    scale = (hi - zero.float()) / levels(bits)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half()
    codes = _quantize(vf, zero.unsqueeze(-1), scale.unsqueeze(-1), bits)
    return pack(codes, bits), scale, zero


class Dequantizer:
    """Codes to floats through a 256-entry table: for int4 one lookup yields both nibbles of a byte."""

    def __init__(self, bits: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.bits = bits
        self.dtype = dtype
        byte = torch.arange(256, device=device)
        if bits == 8:
            self.table = byte.to(dtype).unsqueeze(-1)  # [256, 1]
        else:
            self.table = torch.stack([byte & 15, byte >> 4], dim=-1).to(dtype)  # [256, 2]

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        """[..., w] uint8 -> [..., d] codes as floats."""
        out = self.table[packed.long()]  # [..., w, 1 or 2]
        return out.flatten(-2)

    def keys(self, packed: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
        """packed: [..., bs, w]; kmin / kmax: [..., d] -> [..., bs, d]."""
        scale = key_scale(kmin, kmax, self.bits).to(self.dtype).unsqueeze(-2)
        return torch.addcmul(kmin.to(self.dtype).unsqueeze(-2), self.codes(packed), scale)

    def values(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """packed: [..., w]; scale / zero: [...] -> [..., d]."""
        return torch.addcmul(
            zero.to(self.dtype).unsqueeze(-1), self.codes(packed), scale.to(self.dtype).unsqueeze(-1)
        )
