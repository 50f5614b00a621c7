"""Verifying drafts: every position of a request sampled as plain decoding would sample it.

A chunk with k drafts gives logits at k + 1 positions: after the last known token, and after each
draft. Position p is sampled exactly as a decode step would sample it (same rules, the noise counter
at the request's step + p, penalties and the grammar over the tokens before it); its token is kept,
and the next position counts only when that token is the draft. So every kept token is the token
decoding would have chosen given the same logits: greedy output does not change, and sampled
output keeps its distribution (the draft is a fixed guess, accepted with exactly the probability
the model gives it; on a miss the token drawn is the model's, drawn from the rest of its mass).

Two ways to the same tokens (`sample_positions`' `at_once`). In order: one sampler call per
position, each over the rows still going. At once: the tokens before a kept position p are the
request's tokens and drafts[:p], so a request without a grammar has all its
positions sampled in one call and keeps them up to its first miss; a grammar must advance over kept
tokens only, so a request with one joins that call with position 0 alone and goes on in order.
Each sampler call ends in a device-to-host sync, so on a device at once saves k of them and the
positions past a miss cost next to nothing beside them; on the host there is no sync to save and
every position sampled is time, so the host samples in order. Tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud.engine.sampling.sampler import Sampler, SampleRow, SamplingBatch, needs_penalties
from shared.engine_types import SampleResult


@dataclass(slots=True)
class _Chunk:
    """The step's sampled rows and their positions (sample_positions' arguments, with offsets); the
    tensors on one device."""

    logits: torch.Tensor  # [sum(counts), vocab]
    rows: list[SampleRow]
    counts: list[int]  # logits rows each: 1 + its drafts
    drafts: list[list[int]]
    floats: torch.Tensor  # [rows, 3] fp32: temperature, top_p, min_p
    ints: torch.Tensor  # [rows, 2] int64: top_k, seed
    steps: torch.Tensor  # [rows] int64: tokens each has generated
    offsets: list[int]  # [rows + 1]: row r's positions are logits rows offsets[r] ..

    @classmethod
    def of(
        cls,
        logits: torch.Tensor,
        rows: list[SampleRow],
        counts: list[int],
        drafts: list[list[int]],
        floats: torch.Tensor,
        ints: torch.Tensor,
        steps: torch.Tensor,
    ) -> _Chunk:
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        return cls(logits, rows, counts, drafts, floats, ints, steps, offsets)

    def goes_on(self, r: int, p: int, res: SampleResult) -> bool:
        """Whether row r's position p + 1 counts: p's token is the draft, and a draft follows it."""
        return p + 1 < self.counts[r] and not res.rejected and res.token_id == self.drafts[r][p]


def sample_positions(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SampleRow],
    counts: list[int],
    drafts: list[list[int]],
    floats: torch.Tensor,
    ints: torch.Tensor,
    steps: torch.Tensor,
    *,
    at_once: bool | None = None,
) -> list[list[SampleResult]]:
    """logits: [sum(counts), vocab], each row's positions in turn; drafts[i]: counts[i] - 1 tokens;
    floats / ints / steps: the rows' sampling parameters and tokens generated (input_batch.py).
    Returns each row's kept tokens; appends them to the rows' token lists. `at_once`: the way (None:
    at once on a device, in order on the host)."""
    chunk = _Chunk.of(logits, rows, counts, drafts, floats, ints, steps)
    if at_once is None:
        at_once = logits.device.type != "cpu"
    return _at_once(sampler, chunk) if at_once else _in_order(sampler, chunk)


def _at_once(sampler: Sampler, chunk: _Chunk) -> list[list[SampleResult]]:
    """One sampler call for every position of the rows without a grammar and position 0 of those
    with one; then one call per further position those keep (as _in_order)."""
    rows, drafts = chunk.rows, chunk.drafts
    spans = [c if row.grammar is None else 1 for row, c in zip(rows, chunk.counts, strict=True)]
    owner = [r for r, n in enumerate(spans) for _ in range(n)]
    pos = [p for n in spans for p in range(n)]
    picked = [_at_position(rows[r], drafts[r], p) for r, p in zip(owner, pos, strict=True)]
    x, f, i, s = _positions(chunk, owner, pos)
    results = sampler(x, SamplingBatch(picked, f[:, 0], i[:, 0], f[:, 1], f[:, 2], i[:, 1], s))
    kept: list[list[SampleResult]] = [[] for _ in rows]
    going, at = [], 0
    for r, n in enumerate(spans):
        for p, res in enumerate(results[at : at + n]):
            kept[r].append(res)
            if not chunk.goes_on(r, p, res):
                break
        else:  # only a row with a grammar gets here: its position 0 was its only one this call
            going.append(r)
        rows[r].token_ids.extend(res.token_id for res in kept[r])
        at += n
    _walk(sampler, chunk, kept, going, 1)
    return kept


def _in_order(sampler: Sampler, chunk: _Chunk) -> list[list[SampleResult]]:
    """One sampler call per position, over the rows still going: what decoding would do."""
    kept: list[list[SampleResult]] = [[] for _ in chunk.rows]
    _walk(sampler, chunk, kept, list(range(len(chunk.rows))), 0)
    return kept


def _at_position(row: SampleRow, drafts: list[int], p: int) -> SampleRow:
    """The row as the sampler sees it at position p: its tokens, then drafts[:p]. Only penalties
    read the tokens, so other rows go as they are (a long prompt is not copied per position)."""
    if p == 0 or not needs_penalties(row.params):
        return row
    tokens = row.token_ids + drafts[:p]
    return SampleRow(row.request_id, row.params, row.grammar, tokens, row.num_prompt_tokens)


def _positions(
    chunk: _Chunk, owner: list[int], pos: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, floats, ints and steps for sampling position pos[j] of row owner[j], for each j
    (owner ascending, each row's positions in order from 0): views where the layout allows."""
    n, rows, dev = len(owner), chunk.rows, chunk.floats.device
    where = [chunk.offsets[r] + p for r, p in zip(owner, pos, strict=True)]  # ascending
    if n == len(rows):  # every row at position 0 alone: the plain step, where nothing was drafted
        x = chunk.logits[:n] if where[-1] == n - 1 else chunk.logits.index_select(0, _upload(where, dev))
        return x, chunk.floats, chunk.ints, chunk.steps
    if len(rows) == 1:  # one request (a lone user's stream) at positions 0 .. n - 1: views
        s = chunk.steps + torch.arange(n, dtype=torch.long, device=dev)
        return chunk.logits[:n], chunk.floats.expand(n, -1), chunk.ints.expand(n, -1), s
    index = torch.tensor([where, owner, pos], dtype=torch.long).to(dev, non_blocking=True)  # one upload
    x = chunk.logits[:n] if where[-1] == n - 1 else chunk.logits.index_select(0, index[0])
    at = index[1]
    return x, chunk.floats[at], chunk.ints[at], chunk.steps[at] + index[2]


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _walk(sampler: Sampler, chunk: _Chunk, kept: list[list[SampleResult]], live: list[int], p: int) -> None:
    """Sample position p of the live rows, then p + 1 of those whose token was the draft, and so
    on: one sampler call per position, each token appended to its row before the next call."""
    rows, offsets = chunk.rows, chunk.offsets
    while live:
        if p == 0 and offsets[-1] == len(rows):  # no drafts anywhere: the plain step
            x, f, i, s = chunk.logits, chunk.floats, chunk.ints, chunk.steps
        elif len(live) == 1:  # one request (a lone user's stream): views, no gathers
            r = live[0]
            x, f, i, s = (
                chunk.logits[offsets[r] + p][None],
                chunk.floats[r : r + 1],
                chunk.ints[r : r + 1],
                chunk.steps[r : r + 1] + p,
            )
        else:
            at = _upload(live, chunk.floats.device)
            x = chunk.logits.index_select(0, _upload([offsets[r] + p for r in live], chunk.floats.device))
            f, i, s = chunk.floats[at], chunk.ints[at], chunk.steps[at] + p
        picked = [rows[r] for r in live]
        batch = SamplingBatch(picked, f[:, 0], i[:, 0], f[:, 1], f[:, 2], i[:, 1], s)
        going = []
        for r, res in zip(live, sampler(x, batch), strict=True):
            kept[r].append(res)
            rows[r].token_ids.append(res.token_id)
            if chunk.goes_on(r, p, res):
                going.append(r)
        live, p = going, p + 1
