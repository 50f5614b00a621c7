"""One request's stream read line by line into its timings: what the bench measures per request.

Times are `time.perf_counter()` seconds taken as each line arrives. TTFT runs from the send to the
first chunk that carries content; each later content chunk adds one inter-token latency (ITL), the
gap since the previous one (a chunk holding several tokens shows as one longer gap); E2E runs to
`[DONE]`. Output tokens come from the usage chunk when the server sends one, else they are the count
of content chunks. A request fails on an HTTP error, an error event, a broken connection, or a stream
that ends with neither `[DONE]` nor a finish reason (a truncated answer must not pass for a whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gateway.bench.serving.chunks import Chunk, error_message, read_chunk


class RequestRecord(msgspec.Struct, frozen=True):
    ok: bool
    error: str | None
    ttft_s: float | None  # None when no content arrived
    e2e_s: float
    itl_s: list[float]
    output_tokens: int
    prompt_tokens: int
    usage_reported: bool  # the token counts are the server's, not counted or estimated

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class StreamReader:
    """Fed each line of one response body with the time it arrived; `record` gives the result."""

    start: float
    first: float | None = None  # the first content chunk's arrival
    last: float | None = None  # the latest content chunk's arrival
    end: float | None = None  # [DONE] or the error's arrival
    gaps: list[float] = field(default_factory=list)
    content_chunks: int = 0
    finished: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    event: str = "message"  # the current SSE event's name

    @property
    def over(self) -> bool:
        return self.end is not None

    def feed(self, line: str, now: float) -> None:
        if self.over:
            return
        if not line:
            self.event = "message"  # a blank line ends an event
        elif line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            payload = line[5:].strip()
            if payload == "[DONE]":
                self.end = now
            elif self.event == "error":
                self.fail(error_message(payload), now)
            else:
                self._chunk(read_chunk(payload), now)
        elif line.startswith("error:"):  # llama.cpp's server has framed errors this way
            self.fail(error_message(line[6:]), now)

    def _chunk(self, c: Chunk, now: float) -> None:
        if c.error is not None:
            self.fail(c.error, now)
            return
        if c.text:
            if self.last is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
            self.content_chunks += 1
        self.finished = self.finished or c.finished
        self.prompt_tokens = c.prompt_tokens if c.prompt_tokens is not None else self.prompt_tokens
        if c.completion_tokens is not None:
            self.completion_tokens = c.completion_tokens

    def fail(self, error: str, now: float) -> None:
        if not self.over:
            self.error, self.end = error, now

    def record(self, now: float, prompt_words: int) -> RequestRecord:
        """The request's figures once its body has ended (at `now`); `prompt_words` stands in for the
        prompt's token count when the server reports none."""
        if self.end is None:
            self.end = now
            if not self.finished and self.error is None:
                self.error = "the stream ended without [DONE] or a finish reason"
        return RequestRecord(
            ok=self.error is None,
            error=self.error,
            ttft_s=None if self.first is None else self.first - self.start,
            e2e_s=self.end - self.start,
            itl_s=self.gaps,
            output_tokens=self.content_chunks if self.completion_tokens is None else self.completion_tokens,
            prompt_tokens=prompt_words if self.prompt_tokens is None else self.prompt_tokens,
            usage_reported=self.completion_tokens is not None,
        )
