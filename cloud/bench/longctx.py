"""`ctxfuse bench longctx`: passkey and needle-in-a-haystack retrieval (and, when asked for, RULER's
harder families and a NoLiMa-style task) across context lengths and needle depths, for several engine
configurations (dense, sparse attention, quantized KV cache, and dense without YaRN), with prefill,
decode, decode-attention time, KV bytes per token and peak RSS beside accuracy, RULER's effective
length per task, and every figure's ratio to dense measured in the same run.

This module is the command line (`add_longctx_parser` for `ctxfuse bench`, `main` for
`python -m cloud.bench.longctx`) and the worker processes' entry point (`--worker SPEC`, hidden).
The run itself: longctx_run.py (parent), longctx_worker.py (one configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from cloud.engine.config import DTYPES
from cloud.model.formats import WEIGHT_QUANTS

from .longctx_configs import ABLATIONS, CONFIGS, DEFAULT_NATIVE_CONTEXT, DEFAULT_YARN_FACTOR, REFERENCE, Grid
from .longctx_data import TASKS, Task
from .longctx_results import WorkerLine, WorkerSpec
from .longctx_ruler import CWE_ANSWER_TOKENS, MULTIVALUE_ANSWER_TOKENS, VARTRACK_ANSWER_TOKENS
from .longctx_run import LongCtxOptions, Report, run

QUICK_GRID = Grid(("passkey",), (2048, 4096), (0, 50, 100))
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c != "dense-allkv" and c not in ABLATIONS)
# the tasks of earlier runs, so that a run without --tasks stays comparable with them; the others
# (longer answers, so slower) run when named
DEFAULT_TASKS: tuple[Task, ...] = ("passkey", "needle")
FULL_GRID = Grid(DEFAULT_TASKS, (2048, 4096, 8192, 16384, 32768), (0, 25, 50, 75, 100))
TASK_HELP = (
    "passkey (a key in repeated filler), needle (a magic number in varied prose), multikey (the "
    "number of one of four subjects), multivalue (all four numbers of one subject), vartrack (every "
    "variable of a chain of assignments), cwe (the ten most common words of a list; depth only varies "
    "the list), nolima (a character found through a landmark the question does not name)"
)


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers; a K suffix means x1024 ("2K,32K")."""
    try:
        vals = tuple(int(x[:-1]) * 1024 if x[-1:] in "kK" else int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.split(",") if x)
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


def _add_options(p: argparse.ArgumentParser) -> None:
    full, quick = FULL_GRID, QUICK_GRID
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run of a few minutes on a CPU: lengths {','.join(map(str, quick.lengths))}, depths "
        f"{','.join(map(str, quick.depths))}, passkey only (options given explicitly still win)",
    )
    p.add_argument(
        "--configs",
        type=_names(tuple(CONFIGS)),
        default=DEFAULT_CONFIGS,
        help=f"configurations to compare (default all but dense-allkv and the selection ablations: "
        f"{','.join(DEFAULT_CONFIGS)}; the ablations: {','.join(ABLATIONS)}); "
        f"{REFERENCE} always runs, first: it is the reference for agreement and ratios. dense-noyarn runs "
        "only the lengths above the native context up to twice it, with unscaled RoPE; dense-allkv (every "
        "layer keeps every token's KV) differs from dense only for a model with sliding-window layers",
    )
    p.add_argument(
        "--tasks",
        type=_names(TASKS),
        default=None,
        help=f"comma-separated, of: {TASK_HELP} (default {','.join(DEFAULT_TASKS)})",
    )
    p.add_argument(
        "--lengths",
        type=_ints,
        default=None,
        help=f"tokens per case, prompt + answer, e.g. 2K,4K (default {','.join(map(str, full.lengths))})",
    )
    p.add_argument(
        "--depths",
        type=_ints,
        default=None,
        help=f"needle depths, percent of the haystack (default {','.join(map(str, full.depths))})",
    )
    p.add_argument("--samples", type=int, default=1, help="cases per (task, length, depth) cell (default 1)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=12,
        help="new tokens per answer, greedy (default 12); multivalue, vartrack and cwe answer with a list "
        f"and take at least {MULTIVALUE_ANSWER_TOKENS}, {VARTRACK_ANSWER_TOKENS} and {CWE_ANSWER_TOKENS}",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="keys, subjects and haystacks follow from it (default 0)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench-results/longctx"), help="output folder (default %(default)s)"
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="follow each case's needle through sparse selection, per layer (rank, attended, mass kept): "
        "probe-<config>.md beside results.json; timings leave the probe's own time out",
    )
    p.add_argument(
        "--heads",
        type=Path,
        default=None,
        help="the retrieval-head calibration the -duo configurations keep dense (`ctxfuse serve "
        "--sparse-retrieval-heads`); made by the first configuration that needs it when missing "
        "(default: heads.json in --out)",
    )
    p.add_argument(
        "--native-context",
        type=int,
        default=DEFAULT_NATIVE_CONTEXT,
        help="the model's trained context: longer cases run with YaRN and max_model_len = this x the factor "
        f"(default {DEFAULT_NATIVE_CONTEXT}, SmolLM2's)",
    )
    p.add_argument(
        "--yarn-factor", type=float, default=DEFAULT_YARN_FACTOR, help="YaRN factor (default %(default)g)"
    )
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default SmolLM2)")
    g.add_argument(
        "--device",
        default="auto",
        help="auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="default auto: bfloat16 on a GPU, float32 on a CPU",
    )
    g.add_argument(
        "--weight-quant",
        choices=WEIGHT_QUANTS,
        default="none",
        help="weight format, as for `ctxfuse generate` (default none: exact float32 weights; auto times "
        "kernels at each engine start and may choose differently per configuration)",
    )


def options(args: argparse.Namespace) -> LongCtxOptions:
    defaults = QUICK_GRID if args.quick else FULL_GRID
    if args.samples < 1 or args.max_tokens < 1:
        raise SystemExit("ctxfuse bench longctx: --samples and --max-tokens must be at least 1")
    if any(d > 100 for d in args.depths or ()):
        raise SystemExit("ctxfuse bench longctx: depths are percentages (0 .. 100)")
    grid = Grid(
        tasks=args.tasks or defaults.tasks,
        lengths=tuple(sorted(set(args.lengths or defaults.lengths))),
        depths=tuple(sorted(set(args.depths or defaults.depths))),
        samples=args.samples,
        native_context=args.native_context,
        yarn_factor=args.yarn_factor,
    )
    configs = (REFERENCE, *(c for c in dict.fromkeys(args.configs) if c != REFERENCE))
    return LongCtxOptions(
        configs=configs,
        grid=grid,
        seed=args.seed,
        max_tokens=args.max_tokens,
        out=args.out,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        weight_quant=args.weight_quant,
        quick=args.quick,
        probe=args.probe,
        heads=args.heads or args.out / "heads.json",
    )


def _table(report: Report) -> str:
    """One line per configuration: its figures, then its ratios to the reference (accuracy as a
    difference in points: a ratio is undefined where the reference scored 0)."""
    head = f"{'config':<17}{'acc':>5}{'same text':>10}{'same num':>9}{'prefill s':>10}{'decode ms':>10}"
    head += f"{'attn ms':>8}{'KV B/tok':>9}{'KV MiB':>8}{'RSS MiB':>8}"
    head += f" | vs {REFERENCE}: acc+ prefill decode attn KV KVpeak RSS"
    lines = [head]

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name, s in report.summary.items():
        v, fig = s.vs_reference, s.figures
        ratios = "-"
        if v is not None:
            figs = (
                v.prefill_s,
                v.decode_ms_per_token,
                v.decode_attention_ms_per_token,
                v.kv_bytes_per_token,
                v.kv_peak_mib,
            )
            acc = f(None if v.accuracy_minus_reference is None else 100 * v.accuracy_minus_reference, "+.0f")
            ratios = " ".join([acc, *(f(x, ".2f") for x in (*figs, v.peak_rss_mib))])
        lines.append(
            f"{name:<17}{f(fig.accuracy, '.0%'):>5}{f(fig.agreement_text, '.0%'):>10}"
            f"{f(fig.agreement_number, '.0%'):>9}{f(fig.prefill_s, '.2f'):>10}"
            f"{f(fig.decode_ms_per_token, '.1f'):>10}{f(fig.decode_attention_ms_per_token, '.1f'):>8}"
            f"{f(fig.kv_bytes_per_token, '.0f'):>9}{f(fig.kv_peak_mib, '.0f'):>8}"
            f"{f(s.peak_rss_mib, '.0f'):>8} | {ratios}"
        )
    for name, r in report.configs.items():
        lines += [f"{name}: {r.status}: {msg}" for msg in r.failures]
    lines += [f"warning: {w}" for w in report.meta.warnings]
    return "\n".join(lines)


def cmd_longctx(args: argparse.Namespace) -> int:
    report = run(options(args))
    print(_table(report), file=sys.stderr)
    brief = {
        "results": str(args.out / "results.json"),
        "heatmaps": [r.heatmap for r in report.configs.values() if r.heatmap],
        "status": {n: r.status for n, r in report.configs.items()},
        "summary": {
            n: {
                "figures": s.figures,
                "vs_reference": s.vs_reference,
                "effective_length": {t: e.length for t, e in s.effective_length.items()},
            }
            for n, s in report.summary.items()
        },
    }
    print(json.dumps(msgspec.to_builtins(brief), indent=2))
    return 0 if all(r.status in ("ok", "skipped") for r in report.configs.values()) else 1


def add_longctx_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "longctx",
        help="passkey / needle-in-a-haystack (and RULER, NoLiMa-style) accuracy, speed and memory per "
        "engine configuration (dense, sparse, int8/int4 KV, YaRN); writes JSON and heatmaps",
    )
    _add_options(p)
    p.set_defaults(func=cmd_longctx)


def _worker_main(spec_json: str) -> int:
    from .longctx_worker import run_worker  # the engine is only the workers' to import

    spec = msgspec.json.decode(spec_json, type=WorkerSpec)
    # the protocol gets its own copy of stdout; fd 1 then points at stderr, so whatever else prints
    # (this code, a library, C code) lands in the worker's log, never among the protocol lines
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(line: WorkerLine) -> None:
        proto.write(msgspec.json.encode(line).decode() + "\n")
        proto.flush()

    run_worker(spec, emit)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return _worker_main(argv[1])
    parser = argparse.ArgumentParser(
        prog="python -m cloud.bench.longctx", description=(__doc__ or "").split("\n\n")[0]
    )
    _add_options(parser)
    return cmd_longctx(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
