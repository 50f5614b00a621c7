"""Verifying drafts: the sampler runs over a request's positions in order, as plain decoding would.

A chunk with k drafts gives logits at k + 1 positions: after the last known token, and after each
draft. Position p is sampled exactly as a decode step would sample it (same rules, the noise counter
at the request's step + p, penalties and the grammar over the tokens before it); its token is kept,
and the next position is looked at only when that token is the draft. So every kept token is the
token decoding would have chosen given the same logits: greedy output does not change, and sampled
output keeps its distribution (the draft is a fixed guess, accepted with exactly the probability
the model gives it; on a miss the token drawn is the model's, drawn from the rest of its mass). The
grammar only ever advances over kept tokens.
"""

from __future__ import annotations

import torch

from cloud.engine.sampling.sampler import Sampler, SampleRow, SamplingBatch
from shared.engine_types import SampleResult


def sample_positions(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SampleRow],
    counts: list[int],
    drafts: list[list[int]],
    floats: torch.Tensor,
    ints: torch.Tensor,
    steps: torch.Tensor,
) -> list[list[SampleResult]]:
    """logits: [sum(counts), vocab], each row's positions in turn; drafts[i]: counts[i] - 1 tokens;
    floats / ints / steps: the rows' sampling parameters and tokens generated (input_batch.py).
    Returns each row's kept tokens; appends them to the rows' token lists."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    kept: list[list[SampleResult]] = [[] for _ in rows]
    live = list(range(len(rows)))
    p = 0
    while live:
        if p == 0 and offsets[-1] == len(rows):  # no drafts anywhere: the plain step
            x, f, i, s = logits, floats, ints, steps
        elif len(live) == 1:  # one request (a lone user's stream): views, no gathers
            r = live[0]
            x, f, i, s = (
                logits[offsets[r] + p][None],
                floats[r : r + 1],
                ints[r : r + 1],
                steps[r : r + 1] + p,
            )
        else:
            at = torch.tensor(live, dtype=torch.long, device=floats.device)
            where = torch.tensor([offsets[r] + p for r in live], dtype=torch.long, device=logits.device)
            x, f, i, s = logits.index_select(0, where), floats[at], ints[at], steps[at] + p
        picked = [rows[r] for r in live]
        batch = SamplingBatch(picked, f[:, 0], i[:, 0], f[:, 1], f[:, 2], i[:, 1], s)
        going = []
        for r, res in zip(live, sampler(x, batch), strict=True):
            kept[r].append(res)
            rows[r].token_ids.append(res.token_id)
            if p + 1 < counts[r] and not res.rejected and res.token_id == drafts[r][p]:
                going.append(r)
        live, p = going, p + 1
    return kept
