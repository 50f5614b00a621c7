"""A paged KV cache stored as int8 or int4 codes (kv_quant.py), with the interface of KVCache.

A block is quantized once it is complete. Until then it lives in full precision in a small staging
area (one slot per partly filled block: at most one per running request), so the newest tokens are
never rounded and every key group sees the block's final min / max. Key min / max are the block
summaries (key_summary.py), taken from the keys before quantization; they are also the key zero
points and scales.

Per step: `begin_step` plans which blocks complete (quantize from the fresh tokens, or from staging
plus fresh tokens) and which stay partial (staging), once for all layers; each layer's `write`
follows the plan. Reads dequantize whole blocks and overlay the staged ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cloud.engine.kv.cache import as_context, head_index
from cloud.engine.kv.key_summary import KeySummaries, StepSlots
from cloud.engine.kv.quant import Dequantizer, code_width, quantize_keys, quantize_values

_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class _WritePlan:
    step: StepSlots
    stage_tokens: torch.Tensor  # [s] tokens of this step that go to staging
    stage_rows: torch.Tensor  # [s] their rows in the flat staging area (slot * bs + offset)
    whole_tokens: torch.Tensor  # [w * bs] tokens of blocks written whole this step, block by block
    finish_slots: torch.Tensor  # [f] staging slots of blocks completed this step
    complete: torch.Tensor  # [w + f] block ids quantized this step: whole ones, then finished ones
    slots: torch.Tensor | None = None  # the slot mapping the layers pass (step.slots when None)

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = self.step.slots

    def to(self, device: torch.device, slots: torch.Tensor, block_size: int) -> _WritePlan:
        """The plan's index tensors on the cache's device (copied once per step, before the layers)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return _WritePlan(
            StepSlots.of(slots, block_size),
            move(self.stage_tokens),
            move(self.stage_rows),
            move(self.whole_tokens),
            move(self.finish_slots),
            move(self.complete),
            slots,
        )


class QuantizedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        bits: int,
        is_free: Callable[[int], bool],
        staging_slots: int = 32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = dev = torch.device(device)
        if bits == 4 and head_dim % 2:
            raise ValueError("int4 KV needs an even head_dim")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.bits = bits
        self._is_free = is_free  # whether the block pool holds no reference to a block
        h, bs, w = num_kv_heads, block_size, code_width(head_dim, bits)
        u8, f16 = torch.uint8, torch.float16
        self.kq = [torch.zeros(h, num_blocks, bs, w, dtype=u8, device=dev) for _ in range(num_layers)]
        self.vq = [torch.zeros(h, num_blocks, bs, w, dtype=u8, device=dev) for _ in range(num_layers)]
        self.vscale = [torch.ones(h, num_blocks, bs, dtype=f16, device=dev) for _ in range(num_layers)]
        self.vzero = [torch.zeros(h, num_blocks, bs, dtype=f16, device=dev) for _ in range(num_layers)]
        self.summaries = KeySummaries(num_layers, num_blocks, h, head_dim, dev)
        self.dequant = Dequantizer(bits, dtype, dev)
        # staging: full-precision rows of partly filled blocks, [h, slots, bs, d] per layer
        stage = (h, staging_slots, bs, head_dim)
        self.stage_k = [torch.zeros(stage, dtype=dtype, device=dev) for _ in range(num_layers)]
        self.stage_v = [torch.zeros(stage, dtype=dtype, device=dev) for _ in range(num_layers)]
        # block -> staging slot or -1: planned on the host, mirrored on the device once per step
        self._stage_host = torch.full((num_blocks,), -1, dtype=torch.long)
        self.stage_of = self._stage_host if dev.type == "cpu" else self._stage_host.to(dev)
        self._free_slots = list(range(staging_slots))
        self._plan: _WritePlan | None = None

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, bits: int, block_size: int
    ) -> float:
        codes = 2 * code_width(head_dim, bits)  # keys and values
        value_params = 2 * 2  # fp16 scale and zero per token
        key_params = KeySummaries.bytes_per_token(1, 1, head_dim, block_size)  # fp16 min, max per channel
        return num_layers * num_kv_heads * (codes + value_params + key_params)

    @property
    def num_staging_slots(self) -> int:
        return self.stage_k[0].shape[1]

    # -- writing ----------------------------------------------------------------------------

    def begin_step(self, slot_mapping: torch.Tensor, device_slots: torch.Tensor | None = None) -> None:
        """slot_mapping: the step's slots on the host (planning reads them); device_slots: the same on
        the cache's device, as the layers will pass them to `write`."""
        step = StepSlots.of(slot_mapping.cpu(), self.block_size)
        self._plan = self._make_plan(step)
        if self.stage_of is not self._stage_host:
            self.stage_of.copy_(self._stage_host, non_blocking=True)
        if device_slots is not None:
            self._plan = self._plan.to(self.device, device_slots, self.block_size)

    def _make_plan(self, step: StepSlots) -> _WritePlan:
        bs = self.block_size
        blocks, offsets = step.blocks.tolist(), step.offsets.tolist()
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for b, o in zip(blocks, offsets, strict=True):
            first.setdefault(b, o)
            last[b] = o
        whole, finished, finish_slots, staged = [], [], [], set()
        for b, lo in first.items():
            done = last[b] == bs - 1
            if done and lo == 0:
                whole.append(b)
                continue
            if lo > 0 and int(self._stage_host[b]) < 0:
                raise RuntimeError(f"KV block {b} continues at offset {lo} but its staged head is gone")
            if lo == 0 and int(self._stage_host[b]) < 0:
                self._stage_host[b] = self._take_slot()
            staged.add(b)
            if done:
                finished.append(b)
                finish_slots.append(int(self._stage_host[b]))
        for b in whole:  # a block reused whole drops a stale staging slot from an earlier life
            self._release(b)
        stage_tokens = [i for i, b in enumerate(blocks) if b in staged]
        stage_rows = [int(self._stage_host[blocks[i]]) * bs + offsets[i] for i in stage_tokens]
        whole_set = set(whole)
        whole_tokens = [i for i, b in enumerate(blocks) if b in whole_set]
        for b in finished:  # read during this step's writes; reusable from the next step on
            self._release(b)
        return _WritePlan(
            step,
            torch.tensor(stage_tokens, dtype=torch.long),
            torch.tensor(stage_rows, dtype=torch.long),
            torch.tensor(whole_tokens, dtype=torch.long),
            torch.tensor(finish_slots, dtype=torch.long),
            torch.tensor(whole + finished, dtype=torch.long),
        )

    def _take_slot(self) -> int:
        if not self._free_slots:
            live = (self._stage_host >= 0).nonzero().squeeze(1).tolist()
            for b in live:  # blocks freed while partly filled keep a slot until collected here
                if self._is_free(b):
                    self._release(b)
        if not self._free_slots:
            self._grow()
        return self._free_slots.pop()

    def _release(self, block: int) -> None:
        slot = int(self._stage_host[block])
        if slot >= 0:
            self._stage_host[block] = -1
            self._free_slots.append(slot)

    def _grow(self) -> None:
        n = self.num_staging_slots
        for stage in (self.stage_k, self.stage_v):
            for i, t in enumerate(stage):
                stage[i] = torch.cat([t, torch.zeros_like(t)], dim=1)
        self._free_slots.extend(range(n, 2 * n))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # k, v: [tokens, kv_heads, head_dim]
        plan = self._plan
        if plan is None or plan.slots is not slot_mapping:
            self.begin_step(slot_mapping)
            plan = self._plan
            if plan is None:
                raise RuntimeError("no write plan for this step")
        self.summaries.update(layer, k, plan.step)
        h, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [h, tokens, d]
        sk, sv = self.stage_k[layer], self.stage_v[layer]
        if plan.stage_tokens.numel():
            rows = plan.stage_rows
            sk.view(h, -1, d).index_copy_(1, rows, kt[:, plan.stage_tokens].to(sk.dtype))
            sv.view(h, -1, d).index_copy_(1, rows, vt[:, plan.stage_tokens].to(sv.dtype))
        if not plan.complete.numel():
            return
        kparts, vparts = [], []
        if plan.whole_tokens.numel():
            kparts.append(kt[:, plan.whole_tokens].reshape(h, -1, bs, d))
            vparts.append(vt[:, plan.whole_tokens].reshape(h, -1, bs, d))
        if plan.finish_slots.numel():
            kparts.append(sk[:, plan.finish_slots])
            vparts.append(sv[:, plan.finish_slots])
        kb, vb = torch.cat(kparts, dim=1), torch.cat(vparts, dim=1)  # [h, complete, bs, d]
        blocks = plan.complete
        kmin, kmax = self.summaries.kmin[layer][:, blocks], self.summaries.kmax[layer][:, blocks]
        self.kq[layer][:, blocks] = quantize_keys(kb, kmin, kmax, self.bits)
        codes, scale, zero = quantize_values(vb, self.bits)
        self.vq[layer][:, blocks] = codes
        self.vscale[layer][:, blocks] = scale
        self.vzero[layer][:, blocks] = zero

    def block_parts(self) -> list[torch.Tensor]:
        """As KVCache.block_parts: a complete block is its codes, value scales and zero points, and
        its key bounds (the key scales). Only complete blocks leave for a tier (registered ones)."""
        return [*self.kq, *self.vq, *self.vscale, *self.vzero, *self.summaries.kmin, *self.summaries.kmax]

    def blocks_loaded(self, block_ids: list[int]) -> None:
        """Blocks written whole from a tier are complete: a stale staging slot of theirs goes."""
        for b in block_ids:
            self._release(b)

    # -- reading ----------------------------------------------------------------------------

    def key_bounds(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.summaries.kmin[layer], self.summaries.kmax[layer]

    def _blocks(
        self, layer: int, heads: torch.Tensor | slice, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        kmin, kmax = self.summaries.kmin[layer], self.summaries.kmax[layer]
        k = self.dequant.keys(self.kq[layer][heads, blocks], kmin[heads, blocks], kmax[heads, blocks])
        v = self.dequant.values(
            self.vq[layer][heads, blocks], self.vscale[layer][heads, blocks], self.vzero[layer][heads, blocks]
        )
        return k, v

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVCache.gather: [nb] -> [h, nb * bs, d]; [b, nb] -> [b, h, nb * bs, d]."""
        flat = blocks.reshape(-1)
        k, v = self._blocks(layer, slice(None), flat)  # [h, n, bs, d]
        slots = self.stage_of[flat]
        staged = (slots >= 0).nonzero().squeeze(1)
        if staged.numel():
            k[:, staged] = self.stage_k[layer][:, slots[staged]]
            v[:, staged] = self.stage_v[layer][:, slots[staged]]
        return as_context(k, blocks), as_context(v, blocks)

    def gather_per_head(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVCache.gather_per_head: [..., h, n] -> [..., h, n * bs, d]."""
        heads = head_index(blocks)
        k, v = self._blocks(layer, heads, blocks)  # [..., h, n, bs, d]
        slots = self.stage_of[blocks]
        staged = slots >= 0
        if bool(staged.any()):
            hs = heads.expand_as(blocks)[staged]
            k[staged] = self.stage_k[layer][hs, slots[staged]]
            v[staged] = self.stage_v[layer][hs, slots[staged]]
        return k.flatten(-3, -2), v.flatten(-3, -2)
