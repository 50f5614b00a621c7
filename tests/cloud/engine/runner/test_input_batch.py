"""The runner's persistent input batch: rows come and go, block tables grow by their new blocks
only, a sliding-window row is rewritten when it drops blocks, and the batch grows past its size."""

from __future__ import annotations

import torch

from cloud.engine.runner.input_batch import InputBatch
from cloud.engine.scheduling.scheduler import NewRequestData
from shared.engine_types import SamplingParams


def _new(tokens: tuple[int, ...] = (1, 2, 3), sliding: bool = False, **params: object) -> NewRequestData:
    return NewRequestData(tokens, len(tokens), SamplingParams(**params), None, sliding)  # type: ignore[arg-type]


def _apply(batch: InputBatch) -> None:
    """What the runner does with the step's upload: write the pending table entries."""
    writes = batch.take_table_writes()
    if writes:
        at = torch.tensor([i for i, _ in writes])
        batch.block_table.view(-1)[at] = torch.tensor([b for _, b in writes], dtype=torch.int32)


def test_tables_grow_by_the_new_blocks_only() -> None:
    batch = InputBatch(4, 8, torch.device("cpu"))
    row = batch.add("a", _new())
    batch.set_blocks(row, [5, 2])
    assert batch.take_table_writes() == [(row * 8, 5), (row * 8 + 1, 2)]
    batch.set_blocks(row, [5, 2])
    assert batch.table_writes == []
    batch.set_blocks(row, [5, 2, 9])
    assert batch.take_table_writes() == [(row * 8 + 2, 9)]


def test_rows_are_reused_and_a_readmission_starts_fresh() -> None:
    batch = InputBatch(2, 4, torch.device("cpu"))
    a = batch.add("a", _new(temperature=0.5, top_k=3, seed=7))
    b = batch.add("b", _new())
    batch.flush_params()
    assert batch.floats[a].tolist() == [0.5, 1.0, 0.0] and batch.ints[a].tolist() == [3, 7]
    batch.remove("a")
    c = batch.add("c", _new(tokens=(9,)))
    assert c == a and batch.state[c] is not None and batch.state[c].token_ids == [9]
    batch.set_blocks(b, [1])
    again = batch.add("b", _new(tokens=(1, 2, 3, 4)))  # preempted, then admitted again
    assert batch.blocks[again] == [] and batch.state[again].token_ids == [1, 2, 3, 4]  # type: ignore[union-attr]


def test_a_sliding_window_row_is_rewritten_when_it_drops_blocks() -> None:
    batch = InputBatch(1, 4, torch.device("cpu"))
    row = batch.add("s", _new(sliding=True))
    batch.set_blocks(row, [4, 5, 6])
    _apply(batch)
    live = batch.set_blocks(row, [4, -1, 6, 7])
    assert live == [4, 6, 7]
    _apply(batch)
    assert batch.block_table[row, :3].tolist() == [4, 6, 7]


def test_the_batch_grows_in_rows_and_width() -> None:
    batch = InputBatch(1, 2, torch.device("cpu"))
    a = batch.add("a", _new())
    batch.set_blocks(a, [3])
    b = batch.add("b", _new())  # past max_rows
    assert batch.max_rows == 2 and {a, b} == {0, 1}
    batch.set_blocks(b, [1, 2, 8])  # past the width: the pending write of "a" moves with it
    _apply(batch)
    assert batch.max_blocks >= 3
    assert batch.block_table[a, 0] == 3 and batch.block_table[b, :3].tolist() == [1, 2, 8]
