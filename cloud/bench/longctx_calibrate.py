"""The retrieval-head calibration (cloud/engine/attention/retrieval_heads.py): synthetic needle
questions answered with dense attention, each query head's attention mass on the needle measured at
every answer query, means kept over the questions the model answered right.

The questions are the benchmark's own needle cases (varied prose, a seven-digit number) under a seed
of their own, so a calibration is never made from the cases it is then scored on. Lengths stay within
the model's trained context: which heads retrieve is a property of the model, and short cases keep
the run to about a minute on a CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from cloud.engine.attention.retrieval_heads import HeadCalibration, NeedleMass
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import LoadedModel
from shared.engine_types import SamplingParams

from .longctx_data import CaseSpec, Encoder, is_correct, make_case

CALIBRATION_SEED = 7919  # apart from every benchmark seed in use (0 by default)
LENGTHS = (2048, 4096)
DEPTHS = (10, 30, 50, 70, 90)
ANSWER_TOKENS = 12


def calibrate_heads(
    loaded: LoadedModel,
    base: EngineConfig,
    lengths: Sequence[int] = LENGTHS,
    depths: Sequence[int] = DEPTHS,
    seed: int = CALIBRATION_SEED,
) -> HeadCalibration:
    """Measure every head over needle cases of `lengths` x `depths`, on a dense engine made from
    `base`. Raises ValueError when the model answers none of them (nothing to learn from)."""
    c = loaded.weights.config
    config = EngineConfig(
        model=base.model,
        device=base.device,
        dtype=base.dtype,
        weight_quant=base.weight_quant,
        max_model_len=max(lengths),
        max_num_seqs=1,
        enable_prefix_caching=False,
        attention="dense",
    )
    core = EngineCore(config, loaded)
    recorder = NeedleMass(core.runner.attention, c.num_layers, c.num_heads)
    core.runner.attention = recorder
    enc = Encoder(core.encode_chat, core.tokenizer)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    right = 0
    for i, spec in enumerate(CaseSpec("needle", n, d) for n in lengths for d in depths):
        case = make_case(spec, enc, ANSWER_TOKENS, seed)
        before = recorder.total.clone(), recorder.counts.clone()
        recorder.follow(case.needle_span, len(case.prompt_ids))
        core.add_request(f"calibrate-{i}", list(case.prompt_ids), params)
        tokens: list[int] = []
        while core.has_work():
            tokens += [t for o in core.step() for t in o.token_ids]
        ok = is_correct(case, core.tokenizer.decode(tokens))
        if ok:
            right += 1
        else:  # a question the model got wrong says nothing of where it looks for answers
            recorder.total, recorder.counts = before
        print(f"[calibrate] {spec}: {'right' if ok else 'wrong'}", file=sys.stderr, flush=True)
    if not right:
        raise ValueError("the model answered none of the calibration questions: no heads to learn from")
    return recorder.calibration(loaded.name, c.num_kv_heads, right)


def describe(cal: HeadCalibration, threshold: float) -> str:
    """One line: how many KV heads the threshold keeps dense, and in which layers."""
    dense = cal.dense_kv_heads(threshold)
    layers = [str(i) for i, row in enumerate(dense.tolist()) if any(row)]
    share = float(dense.float().mean()) if dense.numel() else 0.0
    best = torch.tensor(cal.mass).max()
    return (
        f"{int(dense.sum())} of {dense.numel()} KV heads ({share:.0%}) at threshold {threshold:g}, in "
        f"layers {', '.join(layers) or 'none'}; the highest mean needle mass {float(best):.2f}, "
        f"over {cal.cases} right answers"
    )
