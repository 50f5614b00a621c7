"""Decode-attention micro-benchmark for the GPU check: the Triton kernels on random paged caches with
Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head dim 128), timed per call, with the
bytes each call must read and the share of HBM bandwidth that makes (H200: 4.8 TB/s).

Formats: bf16 (paged_decode), int8 and int4 (paged_decode_quant, codes dequantized in registers),
sparse-2048 (quest_select + sparse_paged_decode over a bf16 cache: sinks 64, window 256, budget
2048 tokens). Every request of a batch has the same context; its blocks are a random permutation
of the pool, so no read is contiguous across blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from kernels.triton.paged_decode import decode_bytes_read, paged_decode
from kernels.triton.paged_decode_quant import decode_quant_bytes_read, paged_decode_quant
from kernels.triton.quest_select import quest_select, quest_select_bytes
from kernels.triton.sparse_decode import sparse_decode_bytes, sparse_paged_decode

HBM_BYTES_PER_S = 4.8e12  # H200, the vendor's datasheet
FORMATS = ("bf16", "int8", "int4", "sparse-2048")


@dataclass(frozen=True, slots=True)
class Shapes:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    quant_block_size: int = 32  # the engine's default for int8 / int4 (key scales are per block)
    sinks: int = 64
    window: int = 256
    budget: int = 2048


@dataclass(frozen=True, slots=True)
class AttentionTiming:
    format: str
    context: int
    batch: int
    ms: float
    bytes_read: int

    @property
    def hbm_share(self) -> float:
        return self.bytes_read / (self.ms / 1e3) / HBM_BYTES_PER_S

    def row(self) -> dict[str, float | int | str]:
        return {**asdict(self), "hbm_share": round(self.hbm_share, 4)}


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds per call: CUDA events through triton's do_bench on a GPU; one timed call
    after a warm-up on a CPU (the dry run only checks that everything runs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _tables(batch: int, blocks: int, pool: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(pool, generator=gen)[: batch * blocks]
    return perm.view(batch, blocks).to(device=device, dtype=torch.int32)


def bench_attention(
    contexts: list[int],
    batches: list[int],
    shapes: Shapes,
    device: torch.device,
    formats: tuple[str, ...] = FORMATS,
) -> list[AttentionTiming]:
    results = []
    for fmt in formats:
        results += _bench_format(fmt, contexts, batches, shapes, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _bench_format(
    fmt: str, contexts: list[int], batches: list[int], s: Shapes, device: torch.device
) -> list[AttentionTiming]:
    gen = torch.Generator().manual_seed(0)
    quant = fmt in ("int8", "int4")
    bs = s.quant_block_size if quant else s.block_size
    pool = max(contexts) * max(batches) // bs + 1
    kvh, d = s.num_kv_heads, s.head_dim
    dtype = torch.bfloat16
    if quant:
        bits = 8 if fmt == "int8" else 4
        w = d if bits == 8 else d // 2
        kq = torch.randint(0, 256, (kvh, pool, bs, w), dtype=torch.uint8, device=device)
        vq = torch.randint(0, 256, (kvh, pool, bs, w), dtype=torch.uint8, device=device)
        kmin = -torch.rand(kvh, pool, d, device=device).half()
        kmax = torch.rand(kvh, pool, d, device=device).half()
        vscale = (torch.rand(kvh, pool, bs, device=device) / 16).half()
        vzero = (-torch.rand(kvh, pool, bs, device=device)).half()
        stage_of = torch.full((pool,), -1, dtype=torch.long, device=device)
        stage = torch.zeros(kvh, 1, bs, d, dtype=dtype, device=device)
    else:
        k = torch.randn(kvh, pool, bs, d, dtype=dtype, device=device)
        v = torch.randn(kvh, pool, bs, d, dtype=dtype, device=device)
        if fmt == "sparse-2048":
            kmin = torch.amin(k, dim=2).half()
            kmax = torch.amax(k, dim=2).half()
    scale = d**-0.5
    out = []
    for ctx in contexts:
        for b in batches:
            q = torch.randn(b, s.num_heads, d, dtype=dtype, device=device)
            blocks = -(-ctx // bs)
            tables = _tables(b, blocks, pool, device, gen)
            lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
            call: Callable[[], object]
            if quant:
                call = partial(
                    paged_decode_quant,
                    q,
                    kq,
                    vq,
                    kmin,
                    kmax,
                    vscale,
                    vzero,
                    stage_of,
                    stage,
                    stage,
                    tables,
                    lens,
                )
                call = partial(call, scale, bits)
                nbytes = decode_quant_bytes_read([ctx] * b, kvh, d, bs, bits)
            elif fmt == "bf16":
                call = partial(paged_decode, q, k, v, tables, lens, scale)
                nbytes = decode_bytes_read(b * ctx, kvh, d, dtype)
            else:
                sink_b, window_b = -(-s.sinks // bs), -(-s.window // bs)
                top = s.budget // bs - sink_b - window_b
                call = partial(_sparse, q, kmin, kmax, k, v, tables, lens, (sink_b, window_b, top), scale)
                chosen = min(blocks, sink_b + top + window_b)
                nbytes = quest_select_bytes(
                    b, s.num_heads, kvh, d, ctx, bs, sink_b, window_b
                ) + sparse_decode_bytes(b, s.num_heads, kvh, d, chosen, bs, kv_dtype=dtype, q_dtype=dtype)
            out.append(AttentionTiming(fmt, ctx, b, time_call(call, device), nbytes))
    return out


def _sparse(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    blocks: tuple[int, int, int],
    scale: float,
) -> torch.Tensor:
    """Quest's selection, then attention over the selected blocks (what one sparse decode costs)."""
    sinks, window, top = blocks
    sel = quest_select(q, kmin, kmax, tables, lens, sinks, window, top, block_size=k.shape[2])
    return sparse_paged_decode(q, k, v, tables, sel, lens, scale)
