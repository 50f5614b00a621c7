"""Dequantize GGUF's K-quant (and 5-bit legacy) blocks in torch, vectorized over all blocks at once.

The formats are ggml's (ggml-common.h): a "super-block" of QK_K = 256 weights carries one or two fp16
(Q8_K: fp32) factors and per-sub-block scales packed into a few bytes; the codes follow, low bits and
high bits in separate planes. Each function takes the raw bytes [blocks, type_size] (uint8) and
returns fp32 [blocks, block_size], computing in the same order as the `gguf` package's numpy
reference (d * scale first, then * code, then - min), so the two agree bit for bit (tests/cloud/model/
test_kquants.py). Q8_0 is here too: a Gemma file's 262K-row embedding is Q8_0, and the numpy
decoder takes seconds over it. Q4_0 / Q4_1 and the float types stay with the numpy reference in
gguf_loader.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[blocks, 2] bytes -> [blocks, 1] fp32 (little-endian fp16, as ggml stores its factors)."""
    return raw.contiguous().view(torch.float16).float()


def _bits(raw: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """raw [..., n] uint8 -> [..., len(shifts), n]: the field at each shift, masked."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=raw.device).view(-1, 1)
    return (raw.unsqueeze(-2) >> s) & mask


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins, [blocks, 8] each.
    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 hold scales and mins 4-7 in
    their nibbles, whose top two bits sit in the spare top bits of bytes 0-7."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def q8_0(b: torch.Tensor) -> torch.Tensor:
    """2 bytes d, 32 int8 codes; w = d * q."""
    return _f16(b[:, :2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def q5_0(b: torch.Tensor) -> torch.Tensor:
    """2 bytes d, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * (q - 16)."""
    n = b.shape[0]
    d = _f16(b[:, :2])
    qh = _bits(b[:, 2:6], list(range(8)), 1).transpose(1, 2).reshape(n, 32)  # little-endian bit i
    ql = _bits(b[:, 6:22], [0, 4], 0x0F).reshape(n, 32)  # low nibbles are weights 0-15
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.float()


def q5_1(b: torch.Tensor) -> torch.Tensor:
    """2 bytes d, 2 bytes m, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * q + m."""
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qh = _bits(b[:, 4:8], list(range(8)), 1).transpose(1, 2).reshape(n, 32)
    ql = _bits(b[:, 8:24], [0, 4], 0x0F).reshape(n, 32)
    return d * (ql | (qh << 4)).float() + m


def q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 scale bytes (4-bit scale, 4-bit min per 16 weights), 64 bytes of 2-bit codes, d, dmin."""
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes of third bits (a set bit means no -4 offset), 64 bytes of 2-bit codes, 12 bytes of
    6-bit signed scales (low nibbles in bytes 0-7, top two bits in bytes 8-11), d."""
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = _bits(packed[:, :8], [0, 4], 0x0F).reshape(n, 16)
    high = _bits(packed[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).view(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _bits(hmask.reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, 12 scale bytes, 128 bytes of nibbles (32 weights per byte run: low then high)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _bits(b[:, 16:144].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32).float()
    return ((d * sc).view(n, 8, 1) * q - (dmin * mn).view(n, 8, 1)).reshape(n, QK_K)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K plus 32 bytes of fifth bits (bit j of byte i: sub-block j, weight i)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)
    ql = _bits(b[:, 48:176].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return ((d * sc).view(n, 8, 1) * q - (dmin * mn).view(n, 8, 1)).reshape(n, QK_K)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    """128 bytes of low nibbles, 64 bytes of top two bits, 16 int8 scales, d; w = d * s * (q - 32)."""
    n = b.shape[0]
    ql = _bits(b[:, :128].reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * scales).view(n, 16, 1) * q).reshape(n, QK_K)


def q8_k(b: torch.Tensor) -> torch.Tensor:
    """fp32 d, 256 int8 codes, 16 int16 block sums (only dot products use them); w = d * q."""
    d = b[:, :4].contiguous().view(torch.float32)
    return d * b[:, 4:260].contiguous().view(torch.int8).float()


# type name -> (weights per block, bytes per block, decoder)
KQUANTS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, q8_0),
    "Q5_0": (32, 22, q5_0),
    "Q5_1": (32, 24, q5_1),
    "Q2_K": (QK_K, 84, q2_k),
    "Q3_K": (QK_K, 110, q3_k),
    "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k),
    "Q6_K": (QK_K, 210, q6_k),
    "Q8_K": (QK_K, 292, q8_k),
}


def dequantize(raw: torch.Tensor, qtype: str, numel: int) -> torch.Tensor:
    """raw: the tensor's bytes (any shape, uint8) -> fp32 [numel]. Raises ValueError on a type not
    listed in KQUANTS or a byte count that is not whole blocks of `numel` weights."""
    if qtype not in KQUANTS:
        raise ValueError(f"no K-quant decoder for {qtype}")
    per_block, size, decode = KQUANTS[qtype]
    flat = raw.reshape(-1)
    if numel % per_block or flat.numel() != numel // per_block * size:
        raise ValueError(f"{flat.numel()} bytes are not {numel} {qtype} weights")
    return decode(flat.view(-1, size)).reshape(numel)
