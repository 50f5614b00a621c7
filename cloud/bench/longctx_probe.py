"""The needle's path through block-sparse selection, as a table per configuration
(`ctxfuse bench longctx --probe`, written as `probe-<config>.md` beside results.json).

Each case of a sparse configuration carries, per sparse layer, what the probe saw
(cloud/engine/attention/sparse_probe.py): at the prompt's last query (prefill, which writes the
first answer token) and over the decode steps, whether the needle's blocks were attended, the
bound's rank of the needle's best block, the dense attention mass the selection kept and the
needle's own dense mass. The table puts the cases that found the needle beside those that lost it,
so a layer where the lost ones stop attending to the needle while its heads still look for it (high
needle mass) stands out; the rows where no head looks (needle mass near 0) cost nothing to miss.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable

from cloud.engine.attention.sparse_probe import LayerTrace

from .longctx_results import CaseResult

# a layer counts as "looking" at the needle where some head gives it this much dense mass
LOOKING = 0.1


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _cell(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:.0%}" if pct else f"{x:.3g}"


def _share(t: LayerTrace) -> float | None:
    return None if t.prefill_selected is None else t.prefill_selected / t.kv_heads


# (header, per layer: the figure over its traces, shown as a share)
COLUMNS: tuple[tuple[str, Callable[[list[LayerTrace]], float | None], bool], ...] = (
    ("prefill: needle attended (KV heads)", lambda ts: _mean(_share(t) for t in ts), True),
    ("prefill: rank", lambda ts: _median(t.prefill_rank for t in ts), False),
    ("prefill: head rank", lambda ts: _median(t.prefill_head_rank for t in ts), False),
    ("prefill: mass kept", lambda ts: _mean(t.prefill_mass_kept for t in ts), True),
    ("prefill: needle mass", lambda ts: _mean(t.prefill_needle_mass for t in ts), False),
    ("decode: attended (steps x heads)", lambda ts: _mean(t.decode_selected for t in ts), True),
    ("decode: rank", lambda ts: _median(t.decode_rank for t in ts), False),
    ("decode: head rank", lambda ts: _median(t.decode_head_rank for t in ts), False),
    ("decode: mass kept", lambda ts: _mean(t.decode_mass_kept for t in ts), True),
    ("decode: needle mass", lambda ts: _mean(t.decode_needle_mass for t in ts), False),
)


def _table(traces: list[list[LayerTrace]]) -> list[str]:
    by_layer: dict[int, list[LayerTrace]] = defaultdict(list)
    for trace in traces:
        for t in trace:
            by_layer[t.layer].append(t)
    lines = ["| layer | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    for layer in sorted(by_layer):
        cells = [_cell(f(by_layer[layer]), pct) for _, f, pct in COLUMNS]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def _lost_where_looked(trace: list[LayerTrace]) -> list[int]:
    """Layers where some head looks at the needle (dense mass at least LOOKING) in decode but the
    selection attended to it in under half of the steps and heads."""
    return [
        t.layer
        for t in trace
        if (t.decode_needle_mass or 0.0) >= LOOKING and (t.decode_selected or 0.0) < 0.5
    ]


def probe_report(config: str, cases: list[CaseResult]) -> str | None:
    """The markdown table of `config`'s probed cases, or None when none of them was probed."""
    probed = [c for c in cases if c.config == config and c.trace and c.error is None]
    if not probed:
        return None
    lines = [
        f"# {config}: the needle through sparse selection",
        "",
        "Per sparse layer, means over cases (rank: median; 1 = the needle's block had the highest bound "
        "among the candidates, 0 = it was always attended, a sink or the recent window; head rank: the same "
        "by the bound of the query head that looks hardest at the needle alone). Mass kept: the "
        "share of dense attention on what the selection attended. Needle mass: the dense attention "
        "mass on the needle's tokens, the highest over query heads.",
        "",
    ]
    for title, group in (
        ("found", [c for c in probed if c.correct]),
        ("lost", [c for c in probed if not c.correct]),
    ):
        lines += [f"## {title} ({len(group)} cases)", ""]
        if not group:
            continue
        lines += [*_table([c.trace or [] for c in group]), ""]
    lines += ["## per case", ""]
    for c in probed:
        lost = _lost_where_looked(c.trace or [])
        where = ", ".join(map(str, lost)) if lost else "none"
        lines.append(
            f"- {c.task} {c.length} @{c.depth}% ({'found' if c.correct else 'lost'}, answer {c.answer!r}): "
            f"layers whose heads look at the needle but whose selection mostly missed it: {where}"
        )
    return "\n".join(lines) + "\n"
