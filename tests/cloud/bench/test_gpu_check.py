"""The GPU check's dry run on this CPU (tiny sizes, every phase but the nested kernel tests), and
the model subset it carries to a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cloud.bench.gpu_attention import FORMATS
from cloud.bench.gpu_check import CheckSizes, run
from cloud.bench.gpu_model import full_depth, write_model_subset
from cloud.model.loading import load_model


def test_the_dry_run_runs_every_phase_and_writes_its_report(tmp_path: Path) -> None:
    report = run(None, torch.device("cpu"), CheckSizes.tiny(), tmp_path, skip_tests=True)
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["device"] == "cpu"
    for phase in ("logits", "attention", "e2e_decode"):
        assert "error" not in json.dumps(saved[phase]), saved[phase]
    attention = report["attention"]
    assert isinstance(attention, list)
    assert {(r["format"], r["batch"]) for r in attention} == {(f, b) for f in FORMATS for b in (1, 2)}
    assert all(r["bytes_read"] > 0 and r["ms"] > 0 for r in attention)
    # the CPU engine in fp32 is the reference itself: identical
    assert saved["logits"]["float32"]["max_abs_logit_diff"] == 0.0
    assert "| bf16 | 64 | 1 |" in (tmp_path / "gpu-check.md").read_text()


def test_the_carried_subset_keeps_the_first_layers_bit_for_bit(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write_model_subset(loaded_model.path, tmp_path / "subset.gguf", 2)
    subset = load_model(path)
    assert subset.weights.config.num_layers == 2
    assert torch.equal(subset.weights.layers[1].wq, loaded_model.weights.layers[1].wq)
    assert torch.equal(subset.weights.embed, loaded_model.weights.embed)
    assert subset.tokenizer.encode("hello world") == loaded_model.tokenizer.encode("hello world")
    deep = full_depth(subset, 5)
    assert deep.weights.config.num_layers == 5 and deep.weights.layers[4] is subset.weights.layers[0]
