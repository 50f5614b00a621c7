"""What the engine hands back per step, and the per-request text state behind it: incremental
detokenization, stop strings (matched on text, never returned), and held-back text so a stop
string that is still forming is never streamed."""

from __future__ import annotations

import time

from cloud.engine.request import FinishReason, Request
from cloud.model.detokenizer import IncrementalDecoder
from cloud.model.tokenizer import Tokenizer
from shared.engine_types import PhaseTimes, RequestOutput


class TextState:
    """The output text of one request: decoded incrementally, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, token_id: int, emit_text: bool) -> tuple[str, bool]:
        """Feed one token; returns (text ready to send, whether a stop string ended the output)."""
        new = self.decoder.feed([token_id])
        if not emit_text:
            return "", False
        start = max(0, len(self.text) - self.hold)
        self.text += new
        if self.stop:
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
        ready = len(self.text) - self.hold if self.stop else len(self.text)
        if ready <= self.sent:
            return "", False
        out = self.text[self.sent : ready]
        self.sent = ready
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


def make_output(
    req: Request, parent_id: str, index: int, text: str, tokens: list[int], finish: FinishReason | None
) -> RequestOutput:
    return RequestOutput(
        request_id=parent_id,
        index=index,
        text=text,
        token_ids=tokens,
        finished=finish is not None,
        finish_reason=finish.value if finish else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(0, req.num_cached_tokens),
        num_output_tokens=len(req.output_token_ids),
        num_truncated_tokens=req.num_truncated_tokens,
        num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens,
        queue_time_s=None
        if req.first_scheduled_time is None
        else req.first_scheduled_time - req.arrival_time,
        phases=None if finish is None else phase_times(req, time.monotonic()),
    )


def phase_times(req: Request, finished: float) -> PhaseTimes:
    """The request's queue, prefill and decode, back to back from its arrival to `finished` (the
    engine's monotonic clock, as every time on the request)."""
    admitted, first_token = req.first_scheduled_time, req.first_token_time
    if admitted is None:
        return PhaseTimes(queue_s=finished - req.arrival_time, prefill_s=None, decode_s=None)
    if first_token is None:
        return PhaseTimes(queue_s=admitted - req.arrival_time, prefill_s=finished - admitted, decode_s=None)
    return PhaseTimes(
        queue_s=admitted - req.arrival_time, prefill_s=first_token - admitted, decode_s=finished - first_token
    )
