"""The runner's persistent input batch (the shape of vLLM v1's): one row per running request, kept
across steps and updated incrementally, so a step uploads only what changed.

A row holds what the runner was told when the request was admitted (scheduler.NewRequestData) and
the tokens it sampled since: the runner never reads the scheduler's mutable Request. On the device
it keeps each row's block table (appended to as blocks are allocated, rewritten only when a
sliding-window request drops blocks or a pruned one trades its prompt's blocks for the kept tokens')
and its sampling parameters as tensors.

Invariant: for every live row, `block_table[row, :len(blocks[row])]` on the device equals
`blocks[row]` once the step's pending table writes are applied (they travel in the step's single
host-to-device copy; see runner.py).
"""

from __future__ import annotations

import torch

from cloud.engine.sampling.sampler import SampleRow, param_row
from cloud.engine.scheduling.scheduler import NewRequestData


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        self.rows: dict[str, int] = {}  # request id -> row
        self._free = list(range(max_rows - 1, -1, -1))
        self.state: list[SampleRow | None] = [None] * max_rows
        self.sliding = [False] * max_rows
        # tokens a row's prompt pruning gave up (kv/prune_plan.py): its positions run ahead of its
        # cache by that many, its block_ids start with that many blocks' -1 (0: not pruned)
        self.pruned = [0] * max_rows
        self.blocks: list[list[int]] = [[] for _ in range(max_rows)]  # what each table row holds
        self.block_table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        # sampling parameters: (temperature, top_p, min_p) fp32 and (top_k, seed) int64 per row
        self.floats = torch.zeros(max_rows, 3, dtype=torch.float32, device=device)
        self.ints = torch.zeros(max_rows, 2, dtype=torch.long, device=device)
        self._new_params: dict[int, tuple[tuple[float, float, float], tuple[int, int]]] = {}
        self.table_writes: list[tuple[int, int]] = []  # (flat index into block_table, block id)

    @property
    def max_rows(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.state[row] = None
            self.blocks[row] = []
            self._new_params.pop(row, None)
            self._free.append(row)

    def add(self, request_id: str, new: NewRequestData) -> int:
        """A row for an admitted request (a re-admission after preemption starts a fresh row)."""
        self.remove(request_id)
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.rows[request_id] = row
        self.state[row] = SampleRow(
            request_id, new.params, new.grammar, list(new.token_ids), new.num_prompt_tokens
        )
        self.sliding[row] = new.sliding
        self.pruned[row] = 0
        self._new_params[row] = param_row(new.params)
        return row

    def set_blocks(self, row: int, block_ids: list[int]) -> list[int]:
        """Bring the row's table up to the request's blocks; returns the live blocks in position
        order (the blocks a sliding-window or pruned request dropped, -1, left out)."""
        known = self.blocks[row]
        if self.sliding[row] or self.pruned[row]:
            live = [b for b in block_ids if b >= 0]
            if live != known:
                self._write(row, 0, live)
                self.blocks[row] = live
            return live
        if len(block_ids) > len(known):  # blocks are only ever appended to a running request
            self._write(row, len(known), block_ids[len(known) :])
            known.extend(block_ids[len(known) :])
        return known

    def _write(self, row: int, start: int, ids: list[int]) -> None:
        if start + len(ids) > self.max_blocks:
            self._grow_blocks(start + len(ids))
        base = row * self.max_blocks + start
        self.table_writes.extend((base + i, b) for i, b in enumerate(ids))

    def take_table_writes(self) -> list[tuple[int, int]]:
        writes, self.table_writes = self.table_writes, []
        return writes

    def flush_params(self) -> None:
        """Upload the sampling parameters of rows added since the last step (admission steps only)."""
        if not self._new_params:
            return
        rows = list(self._new_params)
        floats = torch.tensor([self._new_params[r][0] for r in rows], dtype=torch.float32)
        ints = torch.tensor([self._new_params[r][1] for r in rows], dtype=torch.long)
        index = torch.tensor(rows, dtype=torch.long)
        self.floats.index_copy_(0, index.to(self.device), floats.to(self.device))
        self.ints.index_copy_(0, index.to(self.device), ints.to(self.device))
        self._new_params.clear()

    def _grow_rows(self) -> None:
        n = self.max_rows
        self.block_table = torch.cat([self.block_table, torch.zeros_like(self.block_table)])
        self.floats = torch.cat([self.floats, torch.zeros_like(self.floats)])
        self.ints = torch.cat([self.ints, torch.zeros_like(self.ints)])
        self.state += [None] * n
        self.sliding += [False] * n
        self.pruned += [0] * n
        self.blocks += [[] for _ in range(n)]
        self._free = list(range(2 * n - 1, n - 1, -1))

    def _grow_blocks(self, need: int) -> None:
        """Widen every row (pending flat writes are re-indexed to the new width)."""
        old = self.max_blocks
        width = max(need, 2 * old)
        table = torch.zeros(self.max_rows, width, dtype=torch.int32, device=self.device)
        table[:, :old] = self.block_table
        self.block_table = table
        self.table_writes = [((i // old) * width + i % old, b) for i, b in self.table_writes]
