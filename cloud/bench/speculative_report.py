"""What `ctxfuse bench speculative` (cloud/bench/speculative.py) measures and reports: each batch of
requests as measured, the figures of a configuration at a concurrency, the levels side by side, the
workload's own prompt-lookup replay, and the table printed from them."""

from __future__ import annotations

from dataclasses import dataclass

from cloud.engine.config import Speculative


@dataclass(frozen=True, slots=True)
class Batch:
    """One configuration's requests at one concurrency in one round."""

    config: Speculative
    concurrency: int
    round: int
    tokens: int  # output tokens, all requests
    decode_tokens: int  # output tokens after each request's first
    decode_s: float  # summed over requests: from each one's first token to its last
    wall_s: float
    steps: int
    drafted: int  # EngineStats over the batch
    accepted: int


@dataclass(frozen=True, slots=True)
class Figures:
    tok_s: float  # concurrency 1: decode tokens / decode seconds; higher: output tokens / wall seconds
    tokens: int
    steps: int
    tokens_per_step: float  # at concurrency 1, a request's; higher, the batch's
    drafted: int
    accepted: int
    acceptance: float | None  # accepted / drafted; None: nothing drafted


@dataclass(frozen=True, slots=True)
class Difference:
    round: int
    prompt: int
    question: str
    at_token: int  # the first output position where the answers differ
    off: str  # each answer's text from a few tokens before it
    ngram: str


@dataclass(frozen=True, slots=True)
class Level:
    concurrency: int
    off: Figures
    ngram: Figures
    ratio: float  # ngram / off tokens/s
    identical: int  # answers the same token for token in both configurations
    compared: int
    first_difference: Difference | None


@dataclass(frozen=True, slots=True)
class Workload:
    entries: int
    doc_tokens: int  # the ledger alone
    prompt_tokens_mean: float
    lookup_acceptance: float | None  # prompt lookup replayed over the whole context: accepted / drafted
    lookup_tokens_per_step: float  # the replay's tokens per decode step: what one request can gain
    document_share: float  # output tokens after the first that the replay from the prompt alone drafts
    answers: list[str]  # concurrency 1, without speculation, the first round


@dataclass(frozen=True, slots=True)
class Report:
    options: dict[str, object]
    device: str
    torch_threads: int
    workload: Workload
    levels: list[Level]
    batches: list[Batch]
    goal: str
    goal_met: bool
    warnings: list[str]


def table(r: Report) -> str:
    rows = [
        "| concurrency | off tok/s | ngram tok/s | ngram/off | identical | acceptance "
        "| tokens/step off / ngram |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r.levels:
        acc = "-" if x.ngram.acceptance is None else f"{x.ngram.acceptance:.0%}"
        rows.append(
            f"| {x.concurrency} | {x.off.tok_s:.1f} | {x.ngram.tok_s:.1f} | {x.ratio:.2f}x "
            f"| {x.identical}/{x.compared} | {acc} "
            f"| {x.off.tokens_per_step:.2f} / {x.ngram.tokens_per_step:.2f} |"
        )
    w = r.workload
    acc = "-" if w.lookup_acceptance is None else f"{w.lookup_acceptance:.0%}"
    rows += [
        "",
        f"workload: {w.entries} entries, {w.doc_tokens} ledger tokens, {w.prompt_tokens_mean:.0f} prompt "
        f"tokens; prompt lookup replayed on the answers: acceptance {acc}, {w.lookup_tokens_per_step:.2f} "
        f"tokens per step, {w.document_share:.0%} of the tokens drafted right from the prompt alone",
    ]
    for x in r.levels:
        if (d := x.first_difference) is not None:
            rows.append(
                f"first difference at concurrency {x.concurrency}: round {d.round}, {d.question!r}, token "
                f"{d.at_token}: off {d.off[:60]!r}, ngram {d.ngram[:60]!r}"
            )
    rows += [
        f"goal: {r.goal}: {'met' if r.goal_met else 'NOT met'}",
        f"device: {r.device}, {r.torch_threads} torch threads",
    ]
    return "\n".join(rows + [f"warning: {w}" for w in r.warnings])
