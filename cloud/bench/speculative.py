"""`ctxfuse bench speculative`: prompt-lookup speculation (`--speculative ngram`) against none, measured
in-process on the engine core, side by side in one run, on a document-extraction workload: a ledger of
numbered entries (about `--doc-tokens` tokens) and chat questions that ask for entries word for word.

At concurrency 1 the prompts run one after another and the figure is decode tokens/s: each answer's
tokens after its first over the time from its first token to its last (the prefill falls out). At a
higher concurrency its requests are submitted together and the figure is output tokens over the
batch's wall time. Both cores share one loaded model and are warmed at every concurrency on a question
of their own, so the ledger's prefix is cached and a measured prefill computes only the question.
Rounds alternate the configurations (A B B A ...), so a slow spell of the machine falls on both.

Greedy text must not change: every answer is compared token for token between the two. What there is
to gain is measured apart from the engine: prompt lookup (speculative/ngram.py) replayed over the
answers given without speculation, drafting at every step, from the whole context and from the prompt
alone (the document's spans, not the answer's repeats of itself). SmolLM2-135M copies entries from a
2K-token ledger but loses the thread at 4K, where its answers mostly repeat themselves (the results
warn when the answers copy little of the document); Gemma 3 270M (`--model gemma-3-270m`) copies at 4K.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from cloud.bench.report import publish, say
from cloud.bench.speculative_report import Batch, Difference, Figures, Level, Report, Workload, table
from cloud.bench.speculative_workload import Ledger, make_ledger, questions, replay
from cloud.engine.config import CPU_KV_CACHE_GIB, EngineConfig, Speculative
from cloud.engine.core import EngineCore
from cloud.model.loading import LoadedModel, load_model
from cloud.model.tokenizer import Tokenizer
from shared.engine_types import SamplingParams

GOAL_SPEEDUP = 1.8  # issue 30: ngram/off decode tokens/s at concurrency 1
NO_LOSS = 0.95  # ngram/off at the top concurrency read as no loss: alternated runs differ by a few %
LOW_COPY = 0.2  # below this document share the answers are not extraction: a warning says so
CONFIGS: tuple[Speculative, ...] = ("off", "ngram")


@dataclass(frozen=True, slots=True)
class SpecOptions:
    doc_tokens: int = 4000
    prompts: int = 4  # asked one after another at concurrency 1
    max_tokens: int = 128
    rounds: int = 2
    concurrency: tuple[int, ...] = (1, 32)
    num_speculative_tokens: int = 3
    seed: int = 0
    model: str | None = None  # None: the default model
    out: Path = Path("bench-results/speculative.json")
    device: str = "auto"


# -- measuring ----------------------------------------------------------------------------------


def _serve(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str
) -> tuple[list[list[int]], float, int]:
    """Submit the prompts together and step until all are done: the answers, the summed time from
    each one's first token to its last, and the steps taken."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        core.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    while core.has_work():
        steps += 1
        for o in core.step():
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.token_ids:  # a step may bring several tokens of one request (accepted drafts)
                now = time.perf_counter()
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                out[o.request_id] += o.token_ids
    return [out[r] for r in rids], sum(last[r] - first[r] for r in rids), steps


def _batch(
    core: EngineCore, prompts: list[list[int]], c: int, params: SamplingParams, s: Speculative, r: int
) -> tuple[Batch, list[list[int]]]:
    """Concurrency 1: the prompts one after another; higher: all together."""
    before = core.stats()
    t0 = time.perf_counter()
    groups = [[p] for p in prompts] if c == 1 else [prompts]
    answers: list[list[int]] = []
    decode_s = 0.0
    steps = 0
    for g, group in enumerate(groups):
        outs, spans, n = _serve(core, group, params, f"r{r}c{c}{s}g{g}")
        answers += outs
        decode_s += spans
        steps += n
    wall = time.perf_counter() - t0
    after = core.stats()
    tokens = sum(map(len, answers))
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return Batch(s, c, r, tokens, tokens - len(answers), decode_s, wall, steps, drafted, accepted), answers


# -- the results (their types: speculative_report.py) ------------------------------------------


def _figures(batches: list[Batch]) -> Figures:
    tokens = sum(b.tokens for b in batches)
    steps = sum(b.steps for b in batches)
    drafted = sum(b.drafted for b in batches)
    accepted = sum(b.accepted for b in batches)
    if batches[0].concurrency == 1:
        timed, seconds = sum(b.decode_tokens for b in batches), sum(b.decode_s for b in batches)
    else:
        timed, seconds = tokens, sum(b.wall_s for b in batches)
    tok_s = timed / seconds if seconds else 0.0  # 0: every answer was a single token
    rate = accepted / drafted if drafted else None
    return Figures(tok_s, tokens, steps, tokens / steps, drafted, accepted, rate)


def _level(
    c: int,
    batches: list[Batch],
    answers: dict[tuple[Speculative, int, int], list[list[int]]],
    asked: list[str],
    tokenizer: Tokenizer,
) -> Level:
    off, ngram = (_figures([b for b in batches if b.concurrency == c and b.config == s]) for s in CONFIGS)
    same = total = 0
    first: Difference | None = None
    for r in sorted({b.round for b in batches}):
        for i, (a, b) in enumerate(zip(answers["off", c, r], answers["ngram", c, r], strict=True)):
            total += 1
            same += a == b
            if a != b and first is None:
                at = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
                )
                lo = max(0, at - 8)
                first = Difference(r, i, asked[i], at, tokenizer.decode(a[lo:]), tokenizer.decode(b[lo:]))
    return Level(c, off, ngram, ngram.tok_s / off.tok_s if off.tok_s else 0.0, same, total, first)


def _workload(
    ledger: Ledger, prompts: list[list[int]], answers: list[list[int]], opts: SpecOptions, core: EngineCore
) -> Workload:
    whole = [replay(p, a, opts.max_tokens, core.config, True) for p, a in zip(prompts, answers, strict=True)]
    doc = [replay(p, a, opts.max_tokens, core.config, False) for p, a in zip(prompts, answers, strict=True)]
    drafted = sum(x.drafted for x in whole)
    decode = sum(x.tokens for x in whole)
    return Workload(
        entries=len(ledger.items),
        doc_tokens=len(core.tokenizer.encode(ledger.text, add_special=False)),
        prompt_tokens_mean=sum(map(len, prompts)) / len(prompts),
        lookup_acceptance=sum(x.accepted for x in whole) / drafted if drafted else None,
        lookup_tokens_per_step=decode / max(1, sum(x.steps for x in whole)),
        document_share=sum(x.accepted for x in doc) / max(1, decode),
        answers=[core.tokenizer.decode(a) for a in answers],
    )


def _warnings(work: Workload, levels: list[Level]) -> list[str]:
    out = []
    if work.document_share < LOW_COPY:
        out.append(
            f"the answers copy little of the document ({work.document_share:.0%} of their tokens drafted "
            "right from the prompt alone): the model does not do the task at this length, and what "
            "speculation gains comes from its repeats of itself"
        )
    if levels[0].ngram.drafted == 0:
        out.append(f"ngram drafted nothing at concurrency {levels[0].concurrency}: is speculation on?")
    return out


def run(opts: SpecOptions, loaded: LoadedModel | None = None) -> Report:
    loaded = loaded or load_model(opts.model)
    base = EngineConfig(
        device=opts.device,
        kv_cache_memory_gib=CPU_KV_CACHE_GIB,  # two cores: neither may plan a GPU's whole memory
        max_num_seqs=max(32, *opts.concurrency),
        num_speculative_tokens=opts.num_speculative_tokens,
    )
    cores = {s: EngineCore(replace(base, speculative=s), loaded) for s in CONFIGS}
    ledger = make_ledger(cores["off"].tokenizer, opts.doc_tokens, opts.seed)
    levels = sorted(opts.concurrency)
    asked = questions(ledger, max(opts.prompts, *levels), opts.seed)

    def prompt(q: str) -> list[int]:
        return cores["off"].chat_prompt([{"role": "user", "content": f"{ledger.text}\n\n{q}"}]).token_ids

    prompts = [prompt(q) for q in asked]
    at = {c: prompts[: opts.prompts] if c == 1 else prompts[:c] for c in levels}
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0)
    warm = prompt("Which entry comes first?")
    for s, core in cores.items():  # the ledger into the prefix cache, one-time costs into no round
        for c in sorted({1, *levels}):  # one request first: it computes the ledger for the rest
            _batch(core, [warm] * c, c, replace(params, max_tokens=8), s, -1)
    answers: dict[tuple[Speculative, int, int], list[list[int]]] = {}
    batches: list[Batch] = []
    for r in range(opts.rounds):
        for c in levels:
            for s in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                b, answers[s, c, r] = _batch(cores[s], at[c], c, params, s, r)
                batches.append(b)
                say(
                    f"round {r} c={c} {s}: {b.tokens} tokens in {b.wall_s:.1f} s, {b.steps} steps, "
                    f"{b.accepted}/{b.drafted} drafted tokens accepted"
                )
    results = [_level(c, batches, answers, asked, cores["off"].tokenizer) for c in levels]
    work = _workload(ledger, at[levels[0]], answers["off", levels[0], 0], opts, cores["off"])
    low, top = results[0], results[-1]
    goal = (
        f"ngram/off >= {GOAL_SPEEDUP}x at concurrency {low.concurrency} with identical greedy text, "
        f"no loss (>= {NO_LOSS}x) at concurrency {top.concurrency}"
    )
    met = (
        low.ratio >= GOAL_SPEEDUP and top.ratio >= NO_LOSS and all(x.identical == x.compared for x in results)
    )
    return Report(
        {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        cores["off"].describe_device(),
        torch.get_num_threads(),
        work,
        results,
        batches,
        goal,
        met,
        _warnings(work, results),
    )


# -- the command line ---------------------------------------------------------------------------


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        levels = ()
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return levels


def cmd_speculative(args: argparse.Namespace) -> int:
    opts = SpecOptions(**{f: getattr(args, f) for f in SpecOptions.__dataclass_fields__})
    if min(opts.doc_tokens, opts.prompts, opts.max_tokens, opts.rounds, opts.num_speculative_tokens) < 1:
        print("ctxfuse: every count must be at least 1", file=sys.stderr)
        return 2
    report = run(opts)
    publish(opts.out, asdict(report), table(report))
    return 0


def add_speculative_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = SpecOptions()
    p = bench.add_parser(
        "speculative",
        help="decode tokens/s with prompt-lookup speculation (--speculative ngram) and without, on a "
        "document-extraction workload",
    )
    p.add_argument(
        "--doc-tokens", type=int, default=d.doc_tokens, help="the document, in tokens (default %(default)s)"
    )
    p.add_argument(
        "--prompts", type=int, default=d.prompts, help="questions at concurrency 1 (default %(default)s)"
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per answer (default %(default)s)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="per configuration (default %(default)s)")
    p.add_argument(
        "--concurrency",
        type=_concurrency,
        default=d.concurrency,
        help="requests at once, comma-separated: 1 asks --prompts questions one after another, N asks N "
        "together (default 1,32)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="tokens drafted per step at most (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="the ledger and questions (default %(default)s)")
    p.add_argument(
        "--model", default=d.model, help="a .gguf file, directory or known name (default: the default model)"
    )
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.add_argument(
        "--device",
        default=d.device,
        help="auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    )
    p.set_defaults(func=cmd_speculative)
