"""The long-context benchmark's summary: per configuration its figures (accuracy, prefill, decode,
decode attention, KV bytes per token, peak RSS), its agreement with the reference configuration's
answers, its ratios to the reference, the accuracy grid its heatmap draws, and its effective length
per task.

Ratios and agreement are taken over matched cases only: the same cell (task, length, depth,
sample) with the same prompt ids, run without error by both configurations; so a configuration that
ran fewer cases is not flattered or penalised by the cases it skipped.

Effective length (RULER's): the longest length L such that the configuration's score at L and at
every shorter length it ran reaches a threshold. The score is RULER's: per case the share of its
answer items the answer holds (the accuracy for one item; partial credit for the list tasks, where
the accuracy asks for every item). RULER's threshold is absolute, Llama-2-7B's score at 4K (85.6%);
a 135M model is far below that anywhere, so here it is relative: EFFECTIVE_SHARE (85%) of the
reference configuration's own score on the task at the shortest length of at least EFFECTIVE_BASE
(4096) tokens it has a score at, or at its shortest length if none is that long.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import msgspec

from .longctx_results import CaseResult

Cell = tuple[str, int, int, int]

EFFECTIVE_SHARE = 0.85  # of the reference's score at the base length: the effective length's threshold
EFFECTIVE_BASE = 4096  # the threshold comes from the reference's shortest length at least this long


class Figures(msgspec.Struct, kw_only=True):
    cases: int  # cases that ran to an answer
    errors: int  # cases that failed (not in the figures below)
    accuracy: float | None  # share of answers holding the key
    prefill_s: float | None  # means over the cases
    decode_ms_per_token: float | None
    decode_attention_ms_per_token: float | None
    kv_bytes_per_token: float | None
    kv_peak_mib: float | None = None  # KV memory in use at a case's peak
    agreement_text: float | None = None  # share of matched cases whose answer equals the reference's
    agreement_number: float | None = None  # ... whose first number equals the reference's


class Ratios(msgspec.Struct, kw_only=True):
    """This configuration's mean over the reference's mean, on the matched cases."""

    matched_cases: int
    accuracy: float | None
    accuracy_minus_reference: float | None  # the ratio is undefined where the reference scored 0
    prefill_s: float | None
    decode_ms_per_token: float | None
    decode_attention_ms_per_token: float | None
    kv_bytes_per_token: float | None
    kv_peak_mib: float | None = None
    peak_rss_mib: float | None = None  # per process, so in the overall ratios only


class LengthSummary(msgspec.Struct, kw_only=True):
    figures: Figures
    vs_reference: Ratios | None


class ConfigSummary(msgspec.Struct, kw_only=True):
    figures: Figures
    peak_rss_mib: float | None
    vs_reference: Ratios | None  # None when the reference did not run
    by_length: dict[int, LengthSummary]
    grid: dict[str, dict[int, dict[int, float | None]]]  # task -> length -> depth -> accuracy
    effective_length: dict[str, EffectiveLength]  # task -> its effective length


class EffectiveLength(msgspec.Struct, kw_only=True):
    """One task's effective length. `length` is None where the configuration's shortest length
    already falls below the threshold, or where there is no threshold: the reference has no score on
    the task, or scored 0 (every score would reach a threshold of 0)."""

    threshold: float | None  # the score every length up to the effective one reaches
    base_length: int | None  # the reference's length the threshold is taken at
    length: int | None


def _r(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else _r(a / b)


def _by_cell(cases: Iterable[CaseResult]) -> dict[Cell, CaseResult]:
    return {c.cell: c for c in cases if c.error is None}


def mark_agreement(cases: list[CaseResult], reference: str) -> None:
    """Fill each case's agreement fields from the reference configuration's record of its cell."""
    ref = _by_cell(c for c in cases if c.config == reference)
    for c in cases:
        d = ref.get(c.cell)
        if c.error is None and d is not None and d.prompt_crc == c.prompt_crc:
            c.agrees_text, c.agrees_number = c.answer == d.answer, c.number == d.number


def figures(cases: list[CaseResult]) -> Figures:
    ok = [c for c in cases if c.error is None]
    agreed = [c for c in ok if c.agrees_text is not None]
    return Figures(
        cases=len(ok),
        errors=len(cases) - len(ok),
        accuracy=_r(_mean(float(c.correct) for c in ok)),
        prefill_s=_r(_mean(c.prefill_s for c in ok)),
        decode_ms_per_token=_r(_mean(c.decode_ms_per_token for c in ok)),
        decode_attention_ms_per_token=_r(_mean(c.decode_attention_ms_per_token for c in ok)),
        kv_bytes_per_token=_r(_mean(c.kv_bytes_per_token for c in ok)),
        kv_peak_mib=_r(_mean(c.kv_peak_mib for c in ok)),
        agreement_text=_r(_mean(float(bool(c.agrees_text)) for c in agreed)),
        agreement_number=_r(_mean(float(bool(c.agrees_number)) for c in agreed)),
    )


def ratios(cases: list[CaseResult], ref: dict[Cell, CaseResult]) -> Ratios:
    pairs = [
        (c, d)
        for c in cases
        if c.error is None and (d := ref.get(c.cell)) is not None and d.prompt_crc == c.prompt_crc
    ]

    def over(get: Callable[[CaseResult], float | None]) -> float | None:
        both = [(get(c), get(d)) for c, d in pairs if get(c) is not None and get(d) is not None]
        return _ratio(_mean(a for a, _ in both), _mean(b for _, b in both))

    acc, ref_acc = _mean(float(c.correct) for c, _ in pairs), _mean(float(d.correct) for _, d in pairs)
    return Ratios(
        matched_cases=len(pairs),
        accuracy=_ratio(acc, ref_acc),
        accuracy_minus_reference=None if acc is None or ref_acc is None else _r(acc - ref_acc),
        prefill_s=over(lambda c: c.prefill_s),
        decode_ms_per_token=over(lambda c: c.decode_ms_per_token),
        decode_attention_ms_per_token=over(lambda c: c.decode_attention_ms_per_token),
        kv_bytes_per_token=over(lambda c: c.kv_bytes_per_token),
        kv_peak_mib=over(lambda c: c.kv_peak_mib),
    )


def _grid(cases: list[CaseResult]) -> dict[str, dict[int, dict[int, float | None]]]:
    cells: dict[str, dict[int, dict[int, list[bool]]]] = defaultdict(lambda: defaultdict(dict))
    for c in cases:
        hits = cells[c.task][c.length].setdefault(c.depth, [])
        if c.error is None:
            hits.append(c.correct)
    return {
        task: {
            n: {d: _r(_mean(map(float, h))) for d, h in sorted(row.items())} for n, row in sorted(t.items())
        }
        for task, t in cells.items()
    }


def _score_by_length(cases: list[CaseResult], task: str) -> dict[int, float | None]:
    """Length -> the task's mean RULER score over its finished cases (None: none finished), shortest
    first. RULER's score is the share of a case's answer items the answer holds (`score`): the
    accuracy where one item is asked for, partial credit for a list (multivalue, vartrack, cwe)."""
    hits: dict[int, list[float]] = {}
    for c in cases:
        if c.task == task:
            at = hits.setdefault(c.length, [])
            if c.error is None:
                at.append(float(c.correct) if c.score is None else c.score)
    return {n: _mean(h) for n, h in sorted(hits.items())}


def effective_length(mine: list[CaseResult], ref_cases: list[CaseResult], task: str) -> EffectiveLength:
    """The task's effective length for the configuration whose cases are `mine`: its lengths are those
    it has cases at, errors included (a length whose cases all failed has no score: it falls short)."""
    ref = {n: a for n, a in _score_by_length(ref_cases, task).items() if a is not None}
    base = next((n for n in ref if n >= EFFECTIVE_BASE), next(iter(ref), None))
    if base is None or not ref[base]:
        return EffectiveLength(threshold=None, base_length=base, length=None)
    threshold = EFFECTIVE_SHARE * ref[base]
    length = None
    for n, acc in _score_by_length(mine, task).items():
        if acc is None or acc < threshold:
            break
        length = n
    return EffectiveLength(threshold=_r(threshold), base_length=base, length=length)


def summarise(
    cases: list[CaseResult], peaks: dict[str, float | None], reference: str
) -> dict[str, ConfigSummary]:
    """One summary per configuration in `peaks` (its peak RSS in MiB, None if its worker failed)."""
    ref_cases = [c for c in cases if c.config == reference]
    ref = _by_cell(ref_cases)
    out = {}
    for name, peak in peaks.items():
        mine = [c for c in cases if c.config == name]
        by_length = {}
        for n in sorted({c.length for c in mine}):
            at = [c for c in mine if c.length == n]
            by_length[n] = LengthSummary(figures=figures(at), vs_reference=ratios(at, ref) if ref else None)
        vs = None
        if ref:
            vs = ratios(mine, ref)
            vs.peak_rss_mib = _ratio(peak, peaks.get(reference))
        out[name] = ConfigSummary(
            figures=figures(mine),
            peak_rss_mib=peak,
            vs_reference=vs,
            by_length=by_length,
            grid=_grid(mine),
            effective_length={
                t: effective_length(mine, ref_cases, t) for t in dict.fromkeys(c.task for c in mine)
            },
        )
    return out
