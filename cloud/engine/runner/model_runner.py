"""The model runner owns the device side: it turns a SchedulerOutput (ids, counts, block ids) into
tensors, runs the model over the step's tokens and samples the requests that reached their end.

Per step (decode rows first, then prefill chunks):
1. rows of finished and preempted requests leave the persistent input batch; admitted ones enter;
   block tables grow by the blocks allocated since the last step;
2. the step's inputs (token ids, positions, KV slots, batch rows, context lengths, the rows whose
   logits are wanted, the block-table writes) are packed into one host buffer, pinned on a GPU,
   and copied to the device at once;
3. the model runs (a captured CUDA graph for a decode step at a captured batch size, see
   cuda_graphs.py), the sampler picks tokens on the device, and `tolist()` brings them back: the
   step's one synchronisation.
The runner never reads the scheduler's Request: what it needs arrived in NewRequestData.

KV pruning (kv/prune.py, kv/prune_plan.py): while a request whose prompt exceeds the prune budget computes its
prompt's last OBSERVATION_WINDOW positions, the runner keeps their queries (every layer's); when the
scheduler then sends its PruneOrder, the kept keys and values are copied before the step's forward,
and the row attends over its pruned cache from then on (its positions run on from the prompt's end).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cloud.engine.attention.dense import (
    AnyKVCache,
    AttentionBackend,
    AttentionMetadata,
    BoundAttention,
    PrefillSeq,
)
from cloud.engine.attention.window import with_windows
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.prune import compact
from cloud.engine.kv.prune_plan import OBSERVATION_WINDOW, PruneOrder, prunes
from cloud.engine.runner.cuda_graphs import CudaGraphs
from cloud.engine.runner.input_batch import InputBatch
from cloud.engine.sampling.sampler import Sampler, SampleRow
from cloud.engine.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from cloud.engine.speculative.verify import sample_positions
from cloud.model.causal_lm import CausalLM
from cloud.model.llama import StepAttention
from shared.engine_types import SampleResult


@dataclass(slots=True)
class StepInputs:
    """One step laid out for the model: the device tensors and what the host keeps of them."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [sampled + prompt-scored] rows of the step
    sample_rows: list[SampleRow]  # the sampled requests, in logits order
    sample_steps: torch.Tensor  # [sampled] tokens each has generated
    sample_index: torch.Tensor  # [sampled] their rows in the input batch
    sample_counts: list[int]  # [sampled] logits rows each: 1, or 1 + its drafts (speculative/verify.py)
    drafts: list[list[int]]  # [sampled] the drafted tokens
    prompt_rows: list[tuple[str, int, int]]  # (request id, logits row, prompt position it predicts)
    slots_host: torch.Tensor  # [tokens] the KV slots, on the host (quantized caches plan from them)
    max_position: int
    decode_batch_rows: list[int] = field(default_factory=list)  # input-batch rows of the decode rows
    # (request id, first step row, rows): prompt positions whose queries pruning scores with
    observe: list[tuple[str, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: AnyKVCache,
        attention: AttentionBackend,
        sampler: Sampler,
        sink_blocks: int = 0,
        max_num_seqs: int = 32,
        max_model_len: int = 8192,
        prune_budget: int | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        c = model.config
        windows = [model.attention_window(i) for i in range(c.num_layers)]
        self.attention = with_windows(attention, windows, c.head_dim, sink_blocks)
        self.sampler = sampler
        self.block_size = cache.block_size
        self.sink_blocks = sink_blocks  # of a sliding-window request
        self.device = model.device
        self.batch = InputBatch(max_num_seqs, -(-max_model_len // self.block_size) + 1, self.device)
        self.pin = self.device.type == "cuda"
        self.graphs: CudaGraphs | None = None  # set when decode steps replay captured graphs
        # run at the start of each step, after its prune copies (KV tiers' pending loads: kv/tiers)
        self.before_forward: Callable[[], None] | None = None
        self.prune_budget = prune_budget
        # request id -> its observation window's queries so far, pieces of [layers, rows, heads, d]
        self._observed: dict[str, list[torch.Tensor]] = {}

    # -- the input batch --------------------------------------------------------------------

    def _update_batch(self, out: SchedulerOutput) -> list[tuple[ScheduledChunk, int]]:
        """Rows in and out, tables up to date; each chunk with its batch row."""
        self._drop(out)
        placed = []
        for c in out.chunks:
            row = self.batch.add(c.request_id, c.new) if c.new is not None else self.batch.rows[c.request_id]
            self.batch.set_blocks(row, c.block_ids)
            placed.append((c, row))
        self.batch.flush_params()
        return placed

    def _drop(self, out: SchedulerOutput) -> None:
        for rid in out.finished + out.preempted:
            self.batch.remove(rid)
            self._observed.pop(rid, None)

    def _dropped(self, c: ScheduledChunk, row: int) -> int:
        """Tokens a sliding-window request dropped between its sinks and its window, or a pruned one
        before its kept tokens: what its positions run ahead of its cache (0: none)."""
        if self.batch.pruned[row]:
            return self.batch.pruned[row]
        if not self.batch.sliding[row] or -1 not in c.block_ids:
            return 0
        live = [i for i, b in enumerate(c.block_ids) if b >= 0]
        return (live[self.sink_blocks] - self.sink_blocks) * self.block_size

    # -- laying a step out ------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        placed = self._update_batch(out)
        bs = self.block_size
        decode = [p for p in placed if len(p[0].token_ids) == 1]
        prefill = [p for p in placed if len(p[0].token_ids) > 1]
        ids: list[int] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for c, _ in decode + prefill:
            p = np.arange(c.start_pos, c.start_pos + len(c.token_ids))
            blocks = np.asarray(c.block_ids)
            ids.extend(c.token_ids)
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        drops = [self._dropped(c, row) for c, row in decode]
        ctx = [c.start_pos + 1 - dropped for (c, _), dropped in zip(decode, drops, strict=True)]
        # a sliding row's sinks are rotated on by what it dropped; a pruned row's keys stay as cached
        shifts = [d if self.batch.sliding[row] else 0 for (_, row), d in zip(decode, drops, strict=True)]
        logits_rows, sample_rows, sample_index, prompt_rows, counts = self._logit_rows(decode + prefill)
        steps = [len(r.token_ids) - r.num_prompt_tokens for r in sample_rows]
        seqs_host = []
        row_at = len(decode)
        for c, row in prefill:
            n = len(c.token_ids)
            dropped = self._dropped(c, row)
            start = c.start_pos - dropped  # in the compacted context: sinks, then the window
            shift = dropped if self.batch.sliding[row] else 0
            seqs_host.append((row_at, n, start, row, -(-(start + n) // bs), shift))
            row_at += n
        writes = self.batch.take_table_writes()
        parts = {
            "ids": ids,
            "pos": np.concatenate(pos).tolist(),
            "slots": np.concatenate(slots).tolist(),
            "decode_rows": [row for _, row in decode],
            "ctx": ctx,
            "shift": shifts if any(shifts) else [],
            "logits": logits_rows,
            "steps": steps,
            "sample_index": sample_index,
            "cu_q": [len(decode)] + [q_start + n for q_start, n, *_ in seqs_host],
            "pstart": [start for _, _, start, *_ in seqs_host],
            "prows": [row for _, _, _, row, *_ in seqs_host],
            "write_at": [i for i, _ in writes],
            "write_ids": [b for _, b in writes],
        }
        dev = self._upload(parts)
        if writes:
            self.batch.block_table.view(-1)[dev["write_at"]] = dev["write_ids"].to(torch.int32)
        table = self.batch.block_table
        decode_blocks = decode_mask = decode_lens = decode_shift = None
        if decode:
            width = max(-(-n // bs) for n in ctx)
            decode_blocks = table[dev["decode_rows"], :width].long()
            decode_lens = dev["ctx"]
            if any(n < width * bs for n in ctx):
                valid = torch.arange(width * bs, device=self.device)[None, :] < decode_lens[:, None]
                decode_mask = valid[:, None, None, :]  # [b, 1, 1, width]
            if any(shifts):
                decode_shift = dev["shift"]
        seqs = [
            PrefillSeq(q_start, n, start, table[row, :nb].long(), dropped)
            for q_start, n, start, row, nb, dropped in seqs_host
        ]
        meta = AttentionMetadata(
            dev["slots"],
            len(decode),
            decode_blocks,
            decode_mask,
            seqs,
            decode_lens,
            decode_shift,
            self.sink_blocks * bs,
        )
        meta.max_decode_len = max(ctx, default=0)
        if seqs_host:
            meta.prefill_cu_q = dev["cu_q"] - len(decode)  # offsets within the prefill rows
            meta.prefill_start = dev["pstart"]
            meta.prefill_tables = table[dev["prows"], : max(nb for *_, nb, _ in seqs_host)]
            meta.max_prefill_len = max(n for _, n, *_ in seqs_host)
        return StepInputs(
            dev["ids"],
            dev["pos"],
            meta,
            dev["logits"],
            sample_rows,
            dev["steps"],
            dev["sample_index"],
            counts,
            [c.token_ids[len(c.token_ids) - c.num_drafts :] for c, _ in decode + prefill if c.sample],
            prompt_rows,
            torch.tensor(parts["slots"], dtype=torch.long),
            max(int(p[-1]) for p in pos),
            [row for _, row in decode],
            self._observation_rows(decode + prefill),
        )

    def _logit_rows(
        self, ordered: list[tuple[ScheduledChunk, int]]
    ) -> tuple[list[int], list[SampleRow], list[int], list[tuple[str, int, int]], list[int]]:
        """The step rows whose next-token logits are wanted: sampled rows first (a chunk with drafts:
        its last 1 + drafts rows), then prompt-scored; and how many rows each sampled chunk has."""
        rows: list[int] = []
        sampled: list[SampleRow] = []
        index: list[int] = []
        prompt: list[tuple[str, int, int]] = []
        counts: list[int] = []
        at = 0
        for c, row in ordered:
            n = len(c.token_ids)
            state = self.batch.state[row]
            if state is None:
                raise RuntimeError(f"request {c.request_id} has no row in the input batch")
            if c.sample:
                rows.extend(range(at + n - 1 - c.num_drafts, at + n))
                sampled.append(state)
                index.append(row)
                counts.append(1 + c.num_drafts)
            if state.params.prompt_logprobs is not None:
                last = min(c.start_pos + n, state.num_prompt_tokens - 1)  # predicting prompt tokens only
                prompt += [(c.request_id, at + p - c.start_pos, p + 1) for p in range(c.start_pos, last)]
            at += n
        return rows + [r for _, r, _ in prompt], sampled, index, prompt, counts

    def _observation_rows(self, ordered: list[tuple[ScheduledChunk, int]]) -> list[tuple[str, int, int]]:
        """(request id, first step row, rows) of the prompt's last OBSERVATION_WINDOW positions,
        for each request that will be pruned and computes some of them this step."""
        found = []
        at = 0
        for c, row in ordered:
            state = self.batch.state[row]
            n = len(c.token_ids)
            p = 0 if state is None or self.batch.pruned[row] else state.num_prompt_tokens
            lo, hi = max(c.start_pos, p - OBSERVATION_WINDOW), min(c.start_pos + n, p)
            if prunes(p, self.prune_budget) and lo < hi:
                found.append((c.request_id, at + lo - c.start_pos, hi - lo))
            at += n
        return found

    def _upload(self, parts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Every list as an int64 tensor on the device, from one packed host buffer and one copy."""
        sizes = [len(v) for v in parts.values()]
        host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=self.pin)
        flat = [x for v in parts.values() for x in v]
        if flat:
            host.copy_(torch.tensor(flat, dtype=torch.long))
        dev = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        return dict(zip(parts, dev.split(sizes), strict=True))

    # -- running it -------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Compute the step: the sampled token of every chunk that reached its end, and the prompt
        logprobs of chunks whose request asked for them."""
        result = StepResult()
        self._prune(out.prunes)
        if self.before_forward is not None:  # blocks brought back from the KV tiers (after the prunes)
            self.before_forward()
        if not out.chunks:
            self._drop(out)
            return result
        step = self.prepare(out)
        self.cache.begin_step(step.slots_host, step.meta.slot_mapping)
        logits = self._forward(step)
        n = sum(step.sample_counts)
        if n:
            kept = sample_positions(
                self.sampler,
                logits[:n],
                step.sample_rows,
                step.sample_counts,
                step.drafts,
                self.batch.floats[step.sample_index],
                self.batch.ints[step.sample_index],
                step.sample_steps,
            )
            result.sampled = {r.request_id: res for r, res in zip(step.sample_rows, kept, strict=True)}
        if step.prompt_rows:
            states = {r.request_id: r for r in self.batch.state if r is not None}
            targets = [states[rid].token_ids[p] for rid, _, p in step.prompt_rows]
            tops = [states[rid].params.prompt_logprobs or 0 for rid, _, _ in step.prompt_rows]
            scored = self.sampler.score(logits[n:], targets, tops)
            for (rid, _, p), res in zip(step.prompt_rows, scored, strict=True):
                result.prompt_logprobs.setdefault(rid, []).append((p, res))
        return result

    def _forward(self, step: StepInputs) -> torch.Tensor:
        if self.graphs is not None and not step.observe and self.graphs.can_run(step):
            return self.graphs.run(step)
        bound: StepAttention = BoundAttention(self.attention, self.cache, step.meta)
        if not step.observe:
            return self.model.forward(
                step.input_ids, step.positions, bound, step.logits_rows, step.max_position
            )
        rows = torch.cat([torch.arange(r, r + n) for _, r, n in step.observe]).to(self.device)
        seen = _Observer(bound, rows)
        logits = self.model.forward(step.input_ids, step.positions, seen, step.logits_rows, step.max_position)
        queries = torch.stack(seen.queries)  # [layers, observed rows, heads, d]
        counts = [n for _, _, n in step.observe]
        for (rid, _, _), part in zip(step.observe, queries.split(counts, dim=1), strict=True):
            self._observed.setdefault(rid, []).append(part)
        return logits

    def _prune(self, orders: list[PruneOrder]) -> None:
        """Copy each order's kept KV into its fresh blocks (before the step's forward: the prompt's
        blocks may be another request's from this step on)."""
        for order in orders:
            pieces = self._observed.pop(order.request_id, [])
            row = self.batch.rows.get(order.request_id)
            queries = torch.cat(pieces, dim=1) if pieces else None  # [layers, W, heads, d]
            if row is None or queries is None or queries.shape[1] != OBSERVATION_WINDOW:
                raise RuntimeError(
                    f"request {order.request_id} is due for pruning without its window's queries"
                )
            if not isinstance(self.cache, KVCache):
                raise RuntimeError("KV pruning needs a full-precision KV cache")
            compact(self.cache, order, queries.unbind(0), self.model.config.head_dim**-0.5)
            self.batch.pruned[row] = order.num_prompt_tokens - order.num_kept


class _Observer:
    """The step's attention, keeping each layer's queries at the observed rows (pruning's scores)."""

    def __init__(self, inner: StepAttention, rows: torch.Tensor) -> None:
        self.inner = inner
        self.rows = rows  # [observed] rows of the step
        self.queries: list[torch.Tensor] = []  # per layer: [observed, heads, d]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.queries.append(q.index_select(0, self.rows))
        return self.inner(layer, q, k, v)


@dataclass(slots=True)
class StepResult:
    # request id -> its new tokens (more than one: drafts it accepted, then its own)
    sampled: dict[str, list[SampleResult]] = field(default_factory=dict)
    # request id -> (prompt position, logprob of the prompt token there given what precedes it)
    prompt_logprobs: dict[str, list[tuple[int, SampleResult]]] = field(default_factory=dict)
