"""Re-selection every few tokens (`--sparse-reselect N`, reselect.py): a sparse decode step takes
the blocks each layer chose up to N - 1 tokens before, and chooses afresh when a row opens a block or
the batch changes. The compiled CPU path and the PyTorch reference take the same selections, so the
engine gives the reference's logits with it as without it."""

from __future__ import annotations

import argparse

import pytest
import torch

from cloud.engine.attention.reselect import SelectionReuse
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import SparseConfig
from ctxfuse.engine_cli import add_engine_options, engine_config
from kernels.cpu.paged_attention import available as cpu_kernels_available
from shared.engine_types import SamplingParams
from shared.errors import InvalidRequestError
from tests.cloud.engine.recording import recorded_sparse_core

BS = 8


def _step(reuse: SelectionReuse[str], layers: range, tables: torch.Tensor, lens: list[int]) -> list[str]:
    """One decode step over `layers`: what each layer took (a kept name) or chose (a new name)."""
    got = []
    for layer in layers:
        kept = reuse.lookup(layer, tables, torch.tensor(lens))
        if kept is None:
            kept = f"chosen at {lens} by {layer}"
            reuse.keep(layer, kept)
        got.append(kept)
    return got


def test_a_selection_stands_for_n_tokens_within_its_block() -> None:
    reuse: SelectionReuse[str] = SelectionReuse(4, BS)
    tables = torch.tensor([[5, 9, 2, 7]])
    layers = range(2, 5)
    first = _step(reuse, layers, tables, [17])  # the third block's first token
    assert first == [f"chosen at [17] by {layer}" for layer in layers]
    assert _step(reuse, layers, tables, [18]) == first
    assert _step(reuse, layers, tables, [20]) == first  # three tokens on: still
    assert _step(reuse, layers, tables, [21]) == [f"chosen at [21] by {layer}" for layer in layers]
    assert (reuse.chosen, reuse.reused) == (2, 2)


def test_a_row_that_opens_a_block_chooses_again() -> None:
    reuse: SelectionReuse[str] = SelectionReuse(16, BS)
    tables = torch.tensor([[5, 9, 2, 7]])
    _step(reuse, range(1), tables, [22])
    assert _step(reuse, range(1), tables, [24]) == ["chosen at [22] by 0"]  # the block's last token
    # the 25th token is the first of a new block: the window that held the newest block moved
    assert _step(reuse, range(1), tables, [25]) == ["chosen at [25] by 0"]


@pytest.mark.parametrize(
    "tables, lens",
    [
        (torch.tensor([[5, 9, 2, 7], [1, 3, 4, 6]]), [18, 10]),  # a row joined
        (torch.tensor([[5, 9, 8, 7]]), [18]),  # the table changed (a block replaced)
        (torch.tensor([[5, 9, 2, 7]]), [16]),  # fewer tokens than when it chose: another request
        (torch.tensor([[5, 9, 2, 7]]), [17]),  # as many: the same step asked again (another query)
    ],
    ids=["row-joined", "table-changed", "length-went-back", "same-length"],
)
def test_any_other_change_chooses_afresh(tables: torch.Tensor, lens: list[int]) -> None:
    reuse: SelectionReuse[str] = SelectionReuse(4, BS)
    _step(reuse, range(2), torch.tensor([[5, 9, 2, 7]]), [17])
    assert _step(reuse, range(2), tables, lens) == [f"chosen at {lens} by {layer}" for layer in range(2)]


def test_every_token_keeps_nothing() -> None:
    reuse: SelectionReuse[str] = SelectionReuse(1, BS)
    tables = torch.tensor([[5, 9, 2, 7]])
    _step(reuse, range(2), tables, [17])
    assert _step(reuse, range(2), tables, [18]) == ["chosen at [18] by 0", "chosen at [18] by 1"]
    assert (reuse.chosen, reuse.reused) == (0, 0)


def test_a_count_below_one_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SelectionReuse(0, BS)
    with pytest.raises(InvalidRequestError, match="--sparse-reselect must be at least 1"):
        SparseAttention(None, SparseConfig(reselect=0), 16)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention", "sparse", "--sparse-reselect", "0"])
    assert engine_config(parser.parse_args(["--sparse-reselect", "4"])).sparse.reselect == 4


def _generate(loaded_model, kernels: str, reselect: int, kv_dtype: str):  # type: ignore[no-untyped-def]
    """A 40-token prompt past a 3-block budget, 8 tokens greedy; a 25-token one joins at the third (the
    batch changes) and leaves first. No block completes while decoding: an int8 / int4 block rounds its
    keys once complete, and there the two paths' last-bit differences can round a code apart."""
    sparse = SparseConfig(sinks=8, window=8, budget=24, dense_layers=2, reselect=reselect)
    core, rec = recorded_sparse_core(loaded_model, kernels, sparse, BS, kv_dtype, max_num_seqs=2)
    doc = core.tokenizer.encode("The Rhine begins in the Swiss Alps and flows to the North Sea. " * 4)
    core.add_request("long", doc[:40], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
        if len(tokens.get("long", ())) == 3 and "short" not in tokens:
            short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            core.add_request("short", doc[3:28], short)
            tokens["short"] = []
    reuse = core.runner.attention.reuse  # the reference's own, or the kernel backend's
    return tokens, rec.logits, (reuse.chosen, reuse.reused)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_the_compiled_path_reuses_what_the_reference_reuses(loaded_model, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    if not cpu_kernels_available():
        pytest.skip("the C++ kernels serve a CPU where they could be built")
    ref_tokens, ref_logits, ref_counts = _generate(loaded_model, "torch", 4, kv_dtype)
    got_tokens, got_logits, got_counts = _generate(loaded_model, "cpu", 4, kv_dtype)
    assert got_tokens == ref_tokens
    assert got_logits.keys() == ref_logits.keys()
    for rid, rows in got_logits.items():
        for a, b in zip(rows, ref_logits[rid], strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    chosen, reused = got_counts
    assert got_counts == ref_counts
    assert reused > chosen > 0  # most steps took an earlier selection; blocks and joins chose afresh
