"""Embeddings from the served model's hidden states, run on the engine thread between steps.

An embedding needs no KV cache, no sampling and no scheduler: it is one prompt's forward with the
head left off (the model's `forward(head=False)`), pooled and L2-normalized. So it runs as a job the
serving loop advances by one chunk per pass (async_engine.py), beside the scheduler's steps: a chunk
is at most `budget` tokens (the engine's max_num_batched_tokens), so a long input never holds decode
up for more than one prefill-sized step. Several short inputs pack into one chunk; an input longer
than the budget runs over several chunks, keeping its own keys and values (dense, per layer, in the
model's dtype) between them, released when it finishes.

Pooling: `mean` (default: every position's final-normed hidden state averaged, the BOS included)
or `last` (the last position's, which alone has seen the whole input). The retrieval check in
tests/gateway/test_embeddings.py measured both on the default model: see docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cloud.model.causal_lm import CausalLM
from shared.engine_types import Pooling
from shared.errors import QueueFullError

# [inputs, hidden] fp32 L2-normalized rows, or why the job failed; called once, on the engine thread
EmbedDone = Callable[[torch.Tensor | BaseException], None]


@dataclass(slots=True)
class EmbedJob:
    request_id: str
    inputs: list[list[int]]  # checked by the caller: each non-empty, in the vocabulary, fits the context
    pooling: Pooling
    done: EmbedDone


def awaited_job(
    request_id: str, inputs: list[list[int]], pooling: Pooling
) -> tuple[EmbedJob, asyncio.Future[torch.Tensor]]:
    """A job whose answer (or failure) lands in a future of the running event loop."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[torch.Tensor] = loop.create_future()

    def settle(out: torch.Tensor | BaseException) -> None:
        if answer.done():
            return
        if isinstance(out, BaseException):
            answer.set_exception(out)
        else:
            answer.set_result(out)

    def done(out: torch.Tensor | BaseException) -> None:  # on the engine thread
        with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody waits there
            loop.call_soon_threadsafe(settle, out)

    return EmbedJob(request_id, inputs, pooling, done), answer


@dataclass(slots=True, eq=False)
class _Input:
    """One input's progress: `computed` positions run so far, their keys and values per layer (only
    while the input spans chunks) and the pooled sum of their hidden states."""

    ids: list[int]
    pooling: Pooling
    computed: int = 0
    past_k: list[torch.Tensor] = field(default_factory=list)  # per layer: [computed, kv_heads, d]
    past_v: list[torch.Tensor] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # [hidden] fp32: the sum (mean) or the last row (last)


@dataclass(slots=True, eq=False)
class _Running:
    job: EmbedJob
    inputs: list[_Input]
    next_input: int = 0  # inputs before it are finished


@dataclass(slots=True, eq=False)
class _Segment:
    """One input's share of a chunk: rows q_start .. q_start + q_len, positions from state.computed."""

    state: _Input
    q_start: int
    q_len: int
    keep: bool  # the input continues in a later chunk: keep this chunk's keys and values


def causal_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float
) -> torch.Tensor:
    """q: [L, heads, d] at positions start .. start + L - 1; k, v: [start + L, kv_heads, d] at positions
    0 .. start + L - 1 -> [L, heads, d]. Query p sees keys p - window < j <= p (window None: j <= p)."""
    n_q, n_k = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, d]
    if start == 0 and (window is None or window >= n_k):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qpos = torch.arange(start, start + n_q, device=q.device)[:, None]
        kpos = torch.arange(n_k, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


class _ChunkAttention:
    """The model's `StepAttention` over one chunk of packed inputs: each segment attends causally to
    its own input only (earlier chunks' keys included), within each layer's window."""

    def __init__(self, model: CausalLM, segments: list[_Segment]) -> None:
        self.model = model
        self.segments = segments
        self.scale = model.config.head_dim**-0.5

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        window = self.model.attention_window(layer)
        for seg in self.segments:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            ks, vs, st = k[rows], v[rows], seg.state
            if st.computed:
                ks, vs = torch.cat([st.past_k[layer], ks]), torch.cat([st.past_v[layer], vs])
            if seg.keep:
                if st.computed:
                    st.past_k[layer], st.past_v[layer] = ks, vs
                else:
                    st.past_k.append(ks.clone())
                    st.past_v.append(vs.clone())
            out[rows] = causal_window_attention(q[rows], ks, vs, st.computed, window, self.scale)
        return out


class Embedder:
    """The embedding jobs of one engine, advanced a chunk at a time on the engine thread."""

    def __init__(self, model: CausalLM, budget: int, max_jobs: int) -> None:
        self.model = model
        self.budget = budget  # tokens per chunk
        self.max_jobs = max_jobs
        self._jobs: deque[_Running] = deque()

    def has_work(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbedJob) -> None:
        if len(self._jobs) >= self.max_jobs:
            raise QueueFullError(f"the embedding queue is full ({self.max_jobs} requests)")
        self._jobs.append(_Running(job, [_Input(ids, job.pooling) for ids in job.inputs]))

    def abort(self, request_id: str) -> bool:
        """Drop a job (its caller has gone); True when it was queued."""
        for r in self._jobs:
            if r.job.request_id == request_id:
                self._jobs.remove(r)
                return True
        return False

    def fail_all(self, exc: BaseException) -> None:
        jobs, self._jobs = list(self._jobs), deque()
        for r in jobs:
            r.job.done(exc)

    def run_chunk(self) -> None:
        """Run the next chunk (at most `budget` tokens, from the oldest jobs); a job whose inputs are
        all done hears its vectors. A failing chunk fails the jobs it carried, and only those."""
        segments, jobs = self._pack()
        try:
            self._forward(segments)
        except Exception as exc:
            for r in jobs:
                self._jobs.remove(r)
                r.job.done(exc)
            return
        while self._jobs and self._jobs[0].next_input == len(self._jobs[0].inputs):
            r = self._jobs.popleft()
            pooled = torch.stack([x.pooled for x in r.inputs if x.pooled is not None])
            if r.job.pooling == "mean":
                pooled /= torch.tensor([len(x.ids) for x in r.inputs], dtype=pooled.dtype)[:, None]
            r.job.done(F.normalize(pooled, dim=-1))

    def _pack(self) -> tuple[list[_Segment], list[_Running]]:
        left, rows = self.budget, 0
        segments: list[_Segment] = []
        jobs: list[_Running] = []
        for r in self._jobs:
            jobs.append(r)
            for st in r.inputs[r.next_input :]:
                take = min(left, len(st.ids) - st.computed)
                keep = st.computed + take < len(st.ids)
                segments.append(_Segment(st, rows, take, keep))
                rows, left = rows + take, left - take
                if left == 0:
                    return segments, jobs
        return segments, jobs

    def _forward(self, segments: list[_Segment]) -> None:
        dev = self.model.device
        ids = [t for s in segments for t in s.state.ids[s.state.computed : s.state.computed + s.q_len]]
        pos = [p for s in segments for p in range(s.state.computed, s.state.computed + s.q_len)]
        # the rows whose hidden states are pooled: all of a mean input's, the final one of a last input's
        wanted: list[int] = []
        for s in segments:
            if s.state.pooling == "mean":
                wanted.extend(range(s.q_start, s.q_start + s.q_len))
            elif not s.keep:
                wanted.append(s.q_start + s.q_len - 1)
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            _ChunkAttention(self.model, segments),
            torch.tensor(wanted, dtype=torch.long, device=dev),
            max(pos),
            head=False,
        ).cpu()  # [wanted, hidden] fp32
        at = 0
        for s in segments:
            st = s.state
            if st.pooling == "mean":
                part = hidden[at : at + s.q_len].sum(0)
                st.pooled = part if st.pooled is None else st.pooled + part
                at += s.q_len
            elif not s.keep:
                st.pooled = hidden[at].clone()
                at += 1
            st.computed += s.q_len
            if not s.keep:
                st.past_k, st.past_v = [], []
        for r in self._jobs:
            while r.next_input < len(r.inputs) and r.inputs[r.next_input].computed == len(
                r.inputs[r.next_input].ids
            ):
                r.next_input += 1
