"""Paged decode attention over the quantized KV cache against its PyTorch reference and against the
engine's own DenseAttention.decode, on a real QuantizedKVCache filled through its own writes (under
TRITON_INTERPRET=1 on the CPU).

Tolerances: the kernel and the reference dequantize the same codes identically in fp32, so fp32 runs
agree to rounding (atol 2e-5, rtol 1e-4); bf16 runs differ by the output's bf16 rounding (the
interpreter truncates where torch rounds: 1 ulp, atol = rtol = 1e-2). The engine dequantizes in the
run dtype: fp32 agrees to 1e-4, bf16 (keys, scales and SDPA in bf16) to 3e-2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cloud.engine.attention.dense import DenseAttention
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from kernels.triton.paged_decode_quant import (
    decode_dense_bytes_read,
    decode_quant_bytes_read,
    default_num_splits,
    paged_decode_quant,
    paged_decode_quant_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lengths(kind: str, bs: int) -> list[int]:
    if kind == "mixed":  # a staged last block, a padded row, whole blocks (one finished from staging)
        return [2 * bs + 5, 0, 3 * bs]
    return [1, bs + 1, 2 * bs - 3]  # staged blocks holding 1, 1 and bs - 3 tokens


def _filled_cache(
    bits: int, kv_heads: int, d: int, bs: int, dtype: torch.dtype, lens: list[int], seed: int
) -> tuple[QuantizedKVCache, torch.Tensor]:
    """A one-layer cache whose requests hold `lens` tokens in random, out-of-order blocks, written
    as a prefill step (all but the last token) and a decode step; returns it and the block tables,
    whose padding entries name other requests' blocks (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = 2 * sum(need) + 3
    cache = QuantizedKVCache(1, num_blocks, bs, kv_heads, d, dtype, bits, lambda _: False, staging_slots=2)
    used = torch.randperm(num_blocks, generator=g)[: 2 * sum(need) : 2]  # random ids, out of order
    # padding: blocks of other requests (written, so the engine's masked gather stays finite)
    tables = used[torch.randint(0, len(used), (len(lens), max(need) + 1), generator=g)]
    for r, n in enumerate(need):
        tables[r, :n] = used[sum(need[:r]) : sum(need[: r + 1])]
    steps = [[(r, p) for r, n in enumerate(lens) for p in range(n - 1)]]  # prefill
    steps.append([(r, n - 1) for r, n in enumerate(lens) if n])  # decode
    for pos in steps:
        if not pos:
            continue
        slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for r, p in pos])
        k = torch.randn(len(pos), kv_heads, d, generator=g) * 2
        k[:, :, 3] += 6  # an outlier channel, as real keys have
        v = torch.randn(len(pos), kv_heads, d, generator=g)
        cache.begin_step(slots)
        cache.write(0, k.to(dtype), v.to(dtype), slots)
    return cache, tables


def _kernel_inputs(cache: QuantizedKVCache) -> list[torch.Tensor]:
    tensors = [
        cache.kq[0],
        cache.vq[0],
        cache.summaries.kmin[0],
        cache.summaries.kmax[0],
        cache.vscale[0],
        cache.vzero[0],
        cache.stage_of,
        cache.stage_k[0],
        cache.stage_v[0],
    ]
    return [t.to(DEVICE) for t in tensors]


CASES = [  # bits, group, head_dim, dtype, block_size, num_splits, lengths
    (8, 1, 64, torch.float32, 16, 1, "mixed"),
    (4, 3, 128, torch.float32, 32, 3, "mixed"),
    (8, 8, 128, torch.bfloat16, 32, 2, "short"),
    (4, 8, 64, torch.bfloat16, 16, 1, "mixed"),
    (4, 1, 128, torch.float32, 16, 4, "short"),
    (8, 3, 64, torch.bfloat16, 16, 5, "mixed"),
]


@pytest.mark.parametrize(("bits", "group", "d", "dtype", "bs", "splits", "kind"), CASES)
def test_matches_reference_and_engine(
    bits: int, group: int, d: int, dtype: torch.dtype, bs: int, splits: int, kind: str
) -> None:
    kv_heads = 2
    lens = _lengths(kind, bs)
    cache, tables = _filled_cache(bits, kv_heads, d, bs, dtype, lens, seed=bits * d + group + bs)
    used = torch.cat([tables[r, : -(-n // bs)] for r, n in enumerate(lens)])
    staged = cache.stage_of[used] >= 0
    assert bool(staged.any()) and not bool(staged.all())  # both sources are read
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), kv_heads * group, d, generator=g).to(dtype)
    scale = d**-0.5
    ctx = torch.tensor(lens, dtype=torch.int32)
    args: list[Any] = [q.to(DEVICE), *_kernel_inputs(cache), tables.to(DEVICE), ctx.to(DEVICE), scale, bits]

    out = paged_decode_quant(*args, num_splits=splits)
    ref = paged_decode_quant_reference(*args)
    assert out.dtype == dtype and out.shape == q.shape
    fp32 = dtype == torch.float32
    tol = (2e-5, 1e-4) if fp32 else (1e-2, 1e-2)  # atol, rtol
    torch.testing.assert_close(out, ref, atol=tol[0], rtol=tol[1])
    live = ctx > 0
    assert torch.count_nonzero(out[~live.to(DEVICE)]) == 0 and not bool(out.isnan().any())

    nb = tables.shape[1]
    mask = (torch.arange(nb * bs) < ctx.view(-1, 1)).view(-1, 1, 1, nb * bs)
    engine = DenseAttention(kv_heads * group, kv_heads, d).decode(0, q, cache, tables, mask)
    tol = (1e-4, 1e-4) if fp32 else (3e-2, 3e-2)
    torch.testing.assert_close(out.cpu()[live], engine[live], atol=tol[0], rtol=tol[1])


def test_default_splits_and_given_output() -> None:
    cache, tables = _filled_cache(4, 1, 64, 16, torch.float32, [40, 17], seed=3)
    q = torch.randn(2, 4, 64, device=DEVICE)
    ctx = torch.tensor([40, 17], device=DEVICE)
    args: list[Any] = [q, *_kernel_inputs(cache), tables.to(DEVICE), ctx, 0.125, 4]
    ref = paged_decode_quant_reference(*args)
    out = torch.full_like(q, float("nan"))
    assert paged_decode_quant(*args, out=out) is out
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    rows = torch.empty(4, 2, 64, device=DEVICE).transpose(0, 1)  # strided rows and heads: allowed
    torch.testing.assert_close(paged_decode_quant(*args, num_splits=2, out=rows), ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_quant(*args, out=torch.empty(2, 4, 128, device=DEVICE)[..., ::2])


def test_default_num_splits() -> None:
    cuda = torch.device("cuda")
    assert default_num_splits(3, 2, 100, torch.device("cpu")) == 1
    if not torch.cuda.is_available():  # the H200's 132 SMs, 4 programs each
        assert default_num_splits(1, 1, 1000, cuda) == 64
        assert default_num_splits(2, 8, 1000, cuda) == 33
        assert default_num_splits(64, 8, 1000, cuda) == 2
    assert default_num_splits(1, 1, 3, cuda) == 3
    assert default_num_splits(512, 8, 1000, cuda) == 1


def test_bytes_read() -> None:
    # int8, d 128, bs 16: 6 blocks x 2 heads x (2 * 16 * 128 codes + 4 * 128 + 4 * 16 parameter bytes)
    assert decode_quant_bytes_read([37, 0, 48], 2, 128, 16, 8) == 6 * 2 * (4096 + 512 + 64)
    assert decode_quant_bytes_read([37, 0, 48], 2, 128, 16, 4) == 6 * 2 * (2048 + 512 + 64)
    assert decode_dense_bytes_read([37, 0, 48], 2, 128, 16) == 6 * 2 * 2 * 16 * 128 * 2
    ratio = decode_quant_bytes_read([4096], 8, 128, 32, 4) / decode_dense_bytes_read([4096], 8, 128, 32)
    assert 0.28 < ratio < 0.3


def _valid() -> dict[str, Any]:
    h, nb, bs, d = 2, 4, 16, 64
    args = {
        "q": torch.zeros(1, 4, d),
        "kq": torch.zeros(h, nb, bs, d, dtype=torch.uint8),
        "vq": torch.zeros(h, nb, bs, d, dtype=torch.uint8),
        "kmin": torch.zeros(h, nb, d, dtype=torch.float16),
        "kmax": torch.zeros(h, nb, d, dtype=torch.float16),
        "vscale": torch.ones(h, nb, bs, dtype=torch.float16),
        "vzero": torch.zeros(h, nb, bs, dtype=torch.float16),
        "stage_of": torch.full((nb,), -1),
        "stage_k": torch.zeros(h, 1, bs, d),
        "stage_v": torch.zeros(h, 1, bs, d),
        "block_tables": torch.zeros(1, 2, dtype=torch.int32),
        "context_lens": torch.tensor([3]),
    }
    return {**{k: v.to(DEVICE) for k, v in args.items()}, "scale": 0.125, "bits": 8}


def _set(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda a: a.update(changes)


BAD: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("bits must be 8 or 4", _set(bits=5)),
    ("bytes wide", _set(bits=4)),
    ("kq has dtype", lambda a: a.update(kq=a["kq"].to(torch.int8))),
    ("kmin has dtype", lambda a: a.update(kmin=a["kmin"].float())),
    ("vscale has shape", lambda a: a.update(vscale=a["vscale"][:, :, :8])),
    ("vq has shape", lambda a: a.update(vq=a["vq"][:1])),
    ("do not divide", lambda a: a.update(q=a["q"][:, :3])),
    ("head_dim must be", lambda a: a.update(q=torch.zeros(1, 4, 96, device=DEVICE))),
    ("block_size must be", lambda a: a.update(kq=a["kq"][:, :, :8], vq=a["vq"][:, :, :8])),
    ("block_tables has dtype", lambda a: a.update(block_tables=a["block_tables"].float())),
    ("context_lens has shape", lambda a: a.update(context_lens=a["context_lens"].repeat(2))),
    ("stage_of has dtype", lambda a: a.update(stage_of=a["stage_of"].to(torch.int16))),
    ("stage_v has shape", lambda a: a.update(stage_v=a["stage_v"][..., :32])),
    ("q has dtype", lambda a: a.update(q=a["q"].double())),
    ("contiguous last", lambda a: a.update(stage_k=a["stage_k"].repeat(1, 1, 1, 2)[..., ::2])),
    ("same strides", lambda a: a.update(kq=a["kq"].transpose(0, 1).contiguous().transpose(0, 1))),
    ("scale must be", _set(scale=torch.tensor(0.125))),
    ("q must be a 3-d", lambda a: a.update(q=a["q"][0])),
    ("one device", _set(context_lens=torch.zeros(1, dtype=torch.long, device="meta"))),
]


@pytest.mark.parametrize(("message", "spoil"), BAD, ids=[m for m, _ in BAD])
def test_refuses_bad_input(message: str, spoil: Callable[[dict[str, Any]], None]) -> None:
    args = _valid()
    paged_decode_quant(**args)  # the unspoiled inputs pass
    spoil(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_quant(**args)


@pytest.mark.parametrize("splits", [0, 2.0, True])
def test_refuses_bad_splits(splits: Any) -> None:
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_quant(**_valid(), num_splits=splits)
