"""The model runner owns the device side: it turns a SchedulerOutput (ids, counts, block ids) into
tensors, runs the model over the step's tokens and samples the requests that reached their end.
"""

from __future__ import annotations

import torch

from cloud.model.llama import LlamaModel

from .attention import AttentionBackend, AttentionMetadata, PrefillSeq
from .kv_cache import KVCache
from .sampler import Sampler, SampleResult
from .scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(
        self, model: LlamaModel, cache: KVCache, attention: AttentionBackend, sampler: Sampler
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.sampler = sampler
        self.block_size = cache.block_size

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Lay the step out decode-first; returns input ids, positions and attention metadata."""
        decode = [c for c in chunks if len(c.token_ids) == 1]
        prefill = [c for c in chunks if len(c.token_ids) > 1]
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        for c in decode + prefill:
            p = torch.arange(c.start_pos, c.start_pos + len(c.token_ids))
            ids.extend(c.token_ids)
            pos.append(p)
            slot_parts.append(self._slots(c.block_ids, p))
        positions = torch.cat(pos)
        decode_blocks = decode_mask = None
        if decode:
            ctx = [c.start_pos + 1 for c in decode]
            nblocks = [-(-n // self.block_size) for n in ctx]
            tables = [torch.tensor(c.block_ids[:nb]) for c, nb in zip(decode, nblocks, strict=True)]
            decode_blocks = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # pads with block 0
            width = decode_blocks.shape[1] * self.block_size
            if any(n < width for n in ctx):
                valid = torch.arange(width)[None, :] < torch.tensor(ctx)[:, None]
                decode_mask = valid[:, None, None, :]  # [b, 1, 1, width]
        seqs = []
        row = len(decode)
        for c in prefill:
            n = len(c.token_ids)
            ctx_len = c.start_pos + n
            table = torch.tensor(c.block_ids[: -(-ctx_len // self.block_size)])
            seqs.append(PrefillSeq(row, n, c.start_pos, table))
            row += n
        meta = AttentionMetadata(torch.cat(slot_parts), len(decode), decode_blocks, decode_mask, seqs)
        return torch.tensor(ids, dtype=torch.long), positions, meta

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Compute the step; returns the sampled token of every chunk that reached its end."""
        if not out.chunks:
            return {}
        input_ids, positions, meta = self.prepare(out.chunks)
        ordered = [c for c in out.chunks if len(c.token_ids) == 1] + [
            c for c in out.chunks if len(c.token_ids) > 1
        ]
        rows, sampled = [], []
        row = 0
        for c in ordered:
            row += len(c.token_ids)
            if c.sample:
                rows.append(row - 1)
                sampled.append(c.request)
        if not sampled:
            self.model.forward(
                input_ids, positions, self.cache, self.attention, meta, torch.empty(0, dtype=torch.long)
            )
            return {}
        logits = self.model.forward(
            input_ids, positions, self.cache, self.attention, meta, torch.tensor(rows, dtype=torch.long)
        )
        results = self.sampler(logits, sampled)
        return {r.request_id: res for r, res in zip(sampled, results, strict=True)}
