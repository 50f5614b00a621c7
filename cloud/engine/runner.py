"""The model runner owns the device side: it turns a SchedulerOutput (ids, counts, block ids) into
tensors, runs the model over the step's tokens and samples the requests that reached their end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cloud.model.llama import LlamaModel

from .attention import AnyKVCache, AttentionBackend, AttentionMetadata, BoundAttention, PrefillSeq
from .sampler import Sampler, SampleResult
from .scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: AnyKVCache,
        attention: AttentionBackend,
        sampler: Sampler,
        sink_blocks: int = 0,
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.sampler = sampler
        self.block_size = cache.block_size
        self.sink_blocks = sink_blocks  # of a sliding-window request

    def _live(self, c: ScheduledChunk) -> tuple[list[int], int]:
        """The blocks attention reads, in position order, and how many tokens were dropped between
        the sinks and the window (0 for a request that has dropped none)."""
        if not c.request.sliding or -1 not in c.block_ids:
            return c.block_ids, 0
        live = [i for i, b in enumerate(c.block_ids) if b >= 0]
        dropped = (live[self.sink_blocks] - self.sink_blocks) * self.block_size
        return [c.block_ids[i] for i in live], dropped

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
        decode_blocks = decode_mask = decode_lens = decode_shift = None
        if decode:
            live = [self._live(c) for c in decode]
            ctx = [c.start_pos + 1 - dropped for c, (_, dropped) in zip(decode, live, strict=True)]
            nblocks = [-(-n // self.block_size) for n in ctx]
            tables = [torch.tensor(ids[:nb]) for (ids, _), nb in zip(live, nblocks, strict=True)]
            decode_blocks = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # pads with block 0
            width = decode_blocks.shape[1] * self.block_size
            if any(n < width for n in ctx):
                valid = torch.arange(width)[None, :] < torch.tensor(ctx)[:, None]
                decode_mask = valid[:, None, None, :]  # [b, 1, 1, width]
            decode_lens = torch.tensor(ctx, dtype=torch.long)
            if any(dropped for _, dropped in live):
                decode_shift = torch.tensor([dropped for _, dropped in live], dtype=torch.long)
        seqs = []
        row = len(decode)
        for c in prefill:
            n = len(c.token_ids)
            block_ids, dropped = self._live(c)
            start = c.start_pos - dropped  # in the compacted context: sinks, then the window
            table = torch.tensor(block_ids[: -(-(start + n) // self.block_size)])
            seqs.append(PrefillSeq(row, n, start, table, dropped))
            row += n
        meta = AttentionMetadata(
            torch.cat(slot_parts),
            len(decode),
            decode_blocks,
            decode_mask,
            seqs,
            decode_lens,
            decode_shift,
            self.sink_blocks * self.block_size,
        )
        return torch.tensor(ids, dtype=torch.long), positions, meta

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Compute the step: the sampled token of every chunk that reached its end, and the prompt
        logprobs of chunks whose request asked for them."""
        result = StepResult()
        if not out.chunks:
            return result
        input_ids, positions, meta = self.prepare(out.chunks)
        ordered = [c for c in out.chunks if len(c.token_ids) == 1] + [
            c for c in out.chunks if len(c.token_ids) > 1
        ]
        rows: list[int] = []  # rows whose next-token logits the step needs, sampled rows first
        sampled = []
        prompt_rows: list[tuple[str, int, int]] = []  # (request, row, position of the token it predicts)
        row = 0
        for c in ordered:
            n = len(c.token_ids)
            if c.sample:
                rows.append(row + n - 1)
                sampled.append(c.request)
            if c.request.params.prompt_logprobs is not None:
                last = min(c.start_pos + n, c.request.num_prompt_tokens - 1)  # predicting prompt tokens only
                prompt_rows += [
                    (c.request.request_id, row + p - c.start_pos, p + 1) for p in range(c.start_pos, last)
                ]
            row += n
        index = torch.tensor(rows + [r for _, r, _ in prompt_rows], dtype=torch.long)
        self.cache.begin_step(meta.slot_mapping)
        bound = BoundAttention(self.attention, self.cache, meta)
        logits = self.model.forward(input_ids, positions, bound, index)
        if sampled:
            samples = self.sampler(logits[: len(sampled)], sampled)
            result.sampled = {r.request_id: res for r, res in zip(sampled, samples, strict=True)}
        if prompt_rows:
            requests = {c.request.request_id: c.request for c in ordered}
            targets = [requests[rid].token_ids[pos] for rid, _, pos in prompt_rows]
            tops = [requests[rid].params.prompt_logprobs or 0 for rid, _, _ in prompt_rows]
            scored = self.sampler.score(logits[len(sampled) :], targets, tops)
            for (rid, _, pos), res in zip(prompt_rows, scored, strict=True):
                result.prompt_logprobs.setdefault(rid, []).append((pos, res))
        return result


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, SampleResult] = field(default_factory=dict)  # request id -> its new token
    # request id -> (prompt position, logprob of the prompt token there given what precedes it)
    prompt_logprobs: dict[str, list[tuple[int, SampleResult]]] = field(default_factory=dict)
