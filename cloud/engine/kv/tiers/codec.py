"""Cold blocks at lower precision (`--kv-offload-dtype int8|int4`): what the disk tier stores of a
full-precision cache's block, and back.

Blocks on disk are the coldest the engine keeps; storing them as int8 (or int4) codes takes a quarter
(an eighth) of fp32's bytes, so the same disk bound keeps 4x (8x) the documents and a hit reads that
much less. The quantization is the int8 / int4 KV cache's own (kv/quant.py, KIVI's layout): keys per
channel within the block (its fp16 min and max are the scales), values per token. Hot blocks (the
device pool, the host tier) stay in full precision; a block decoded from disk is exact to half a code
step (|x - x'| <= scale / 2), the error the int8 / int4 KV cache has on every block.

A full-precision record (records.py: per layer keys then values, each [kv_heads, block_size, d], then
the key summaries when kept) becomes: key codes, key min, key max, value codes, value scales, value
zeros, and the summaries' bytes unchanged.
"""

from __future__ import annotations

import torch

from cloud.engine.kv.quant import Dequantizer, code_width, quantize_keys, quantize_values

_F16 = torch.float16


class ColdCodec:
    def __init__(
        self,
        layers: int,
        heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        bits: int,
        tail: int,
    ) -> None:
        """tail: bytes after the keys and values kept as they are (key summaries)."""
        if bits == 4 and head_dim % 2:
            raise ValueError("int4 needs an even head_dim")
        self.shape = (layers, heads, block_size, head_dim)
        self.dtype = dtype
        self.bits = bits
        self.tail = tail
        esize = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes = 2 * layers * heads * block_size * head_dim * esize
        self.full_bytes = self.kv_bytes + tail
        w = code_width(head_dim, bits)
        self._sizes = [
            layers * heads * block_size * w,  # key codes
            layers * heads * head_dim * 2,  # key min (fp16)
            layers * heads * head_dim * 2,  # key max
            layers * heads * block_size * w,  # value codes
            layers * heads * block_size * 2,  # value scales (fp16)
            layers * heads * block_size * 2,  # value zeros
        ]
        self.cold_bytes = sum(self._sizes) + tail
        self._dequant = Dequantizer(bits, torch.float32)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Full records [n, full_bytes] -> cold records [n, cold_bytes] (uint8, on the host)."""
        n = rows.shape[0]
        layers, heads, bs, d = self.shape
        kv = rows[:, : self.kv_bytes].contiguous().view(self.dtype).view(n, layers, 2, heads, bs, d)
        k = kv[:, :, 0].reshape(n * layers, heads, bs, d).float()
        v = kv[:, :, 1].float()
        kmin, kmax = k.amin(2).to(_F16), k.amax(2).to(_F16)  # [n * layers, heads, d]
        kcodes = quantize_keys(k, kmin, kmax, self.bits)
        vcodes, vscale, vzero = quantize_values(v, self.bits)
        parts = [kcodes, kmin, kmax, vcodes, vscale, vzero]
        out = [p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts]
        out.append(rows[:, self.kv_bytes :])
        return torch.cat(out, dim=1)

    def decode(self, cold: torch.Tensor) -> torch.Tensor:
        """Cold records [n, cold_bytes] -> full records [n, full_bytes]."""
        n = cold.shape[0]
        layers, heads, bs, d = self.shape
        pieces, at = [], 0
        for size in self._sizes:
            pieces.append(cold[:, at : at + size].contiguous())
            at += size
        kc, kmin, kmax, vc, vs, vz = pieces
        w = code_width(d, self.bits)
        k = self._dequant.keys(
            kc.view(n, layers, heads, bs, w),
            kmin.view(_F16).view(n, layers, heads, d),
            kmax.view(_F16).view(n, layers, heads, d),
        )
        v = self._dequant.values(
            vc.view(n, layers, heads, bs, w),
            vs.view(_F16).view(n, layers, heads, bs),
            vz.view(_F16).view(n, layers, heads, bs),
        )
        kv = torch.stack([k, v], dim=2).to(self.dtype)  # [n, layers, 2, heads, bs, d]
        full = kv.contiguous().view(torch.uint8).reshape(n, -1)
        return torch.cat([full, cold[:, at:]], dim=1)
