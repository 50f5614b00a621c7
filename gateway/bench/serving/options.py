"""What one `ctxfuse bench serve` invocation measures, checked once where the command line enters."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

Endpoint = Literal["chat", "completions"]
BUILT_IN_DATASETS = ("random", "long-doc")  # any other --dataset value names a ShareGPT-like file
DEFAULT_SWEEP = (1, 8, 32)
DEFAULT_OUTPUT_LEN = 128


@dataclass(frozen=True, slots=True)
class ServeBenchOptions:
    base_urls: tuple[str, ...]  # each server gets every run, with the same prompts
    model: str | None = None  # None: each server's first id from GET /v1/models
    api_key: str | None = None  # never written to the results file
    endpoint: Endpoint = "chat"
    dataset: str = "random"  # "random", "long-doc" or a file's path
    input_len: int = 256  # words (a stand-in for tokens: no tokenizer here)
    output_len: int | None = None  # max_tokens; None: DEFAULT_OUTPUT_LEN, or a file's own lengths
    range_ratio: float = 0.0  # random lengths drawn from [len * (1 - r), len * (1 + r)]
    num_prompts: int = 32  # per run
    concurrency: tuple[int | None, ...] = DEFAULT_SWEEP  # one run per value; None: no cap
    request_rate: float | None = None  # Poisson arrivals per second; None: all at once
    ignore_eos: bool = False
    temperature: float = 0.8
    seed: int = 0
    warmup: int = 1  # requests per server before its first run, not measured
    out: Path = Path("bench-results/serve.json")

    def __post_init__(self) -> None:
        if not self.base_urls:
            raise ValueError("give at least one --base-url")
        if min(self.num_prompts, self.input_len, self.output_len or 1) < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if not self.concurrency or any(c is not None and c < 1 for c in self.concurrency):
            raise ValueError("--concurrency takes values >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.warmup < 0 or self.temperature < 0:
            raise ValueError("--warmup and --temperature must be >= 0")

    @property
    def max_in_flight(self) -> int:
        """The most requests any run keeps in flight: the client's connection limit."""
        return max(self.num_prompts if c is None else min(c, self.num_prompts) for c in self.concurrency)

    def public(self) -> ServeBenchOptions:
        """These options as the results file records them: without the API key."""
        return replace(self, api_key=None)


def normalise_base_url(url: str) -> str:
    """`http://host:8000`, `http://host:8000/` and `http://host:8000/v1` (the OpenAI client's
    base_url) all name the same server."""
    return url.strip().rstrip("/").removesuffix("/v1")
