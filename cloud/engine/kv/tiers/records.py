"""A KV block as one flat record of bytes, and back: what the tiers below the device pool store.

A cache names its per-block state with `block_parts()`: tensors indexed by block id on axis 1
(keys and values of every layer; codes, scales and zero points of a quantized cache; key bounds when
they are kept). A record is those parts' bytes for one block, in that order. Moving n blocks costs
one index_select (out) or index_copy_ (in) per part whatever n is, so blocks travel in batches: the
ones a step evicts, the ones a hit brings back.

A record holds the cache's own storage bytes (fp32, bf16, fp8 or int4 codes as they were), so a
block that comes back is bit for bit the block that left: greedy output is unchanged by a tier hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class _Part:
    tensor: torch.Tensor
    row_shape: tuple[int, ...]  # one block's slice: the shape without axis 1
    nbytes: int  # one block's bytes


class BlockRecords:
    def __init__(self, parts: list[torch.Tensor]) -> None:
        self._parts = []
        for t in parts:
            row = (t.shape[0], *t.shape[2:])
            n = t.element_size()
            for s in row:
                n *= s
            self._parts.append(_Part(t, row, n))
        self.record_bytes = sum(p.nbytes for p in self._parts)
        self.device = parts[0].device

    def layout(self) -> str:
        """What a record's bytes mean (part shapes and dtypes): a stored record is only read back by
        a cache of this layout."""
        return ";".join(f"{tuple(p.row_shape)}:{p.tensor.dtype}" for p in self._parts)

    def export(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' records: [n, record_bytes] uint8 on the host, row i for block_ids[i]."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        pieces = []
        for p in self._parts:
            rows = p.tensor.index_select(1, ids).movedim(1, 0).contiguous()  # [n, *row]
            pieces.append(rows.view(torch.uint8).reshape(len(block_ids), -1))
        return torch.cat(pieces, dim=1).cpu()

    def load(self, block_ids: list[int], records: torch.Tensor) -> None:
        """Write records [n, record_bytes] (uint8, any device) into the blocks, row i to block_ids[i]."""
        n = len(block_ids)
        if records.shape != (n, self.record_bytes):
            raise ValueError(f"records of shape {tuple(records.shape)}, expected ({n}, {self.record_bytes})")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        records = records.to(self.device)
        at = 0
        for p in self._parts:
            raw = records[:, at : at + p.nbytes].contiguous()
            at += p.nbytes
            rows = raw.view(p.tensor.dtype).reshape(n, *p.row_shape).movedim(0, 1)
            p.tensor.index_copy_(1, ids, rows)
