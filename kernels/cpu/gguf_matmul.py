"""Linear layers on GGUF-quantized weights (Q4_0, Q4_1, Q8_0) without dequantizing the matrix:
`gguf_linear(x, w)` reads the file's own 32-weight blocks (18, 20 or 34 bytes) and computes
x @ W^T in fp32, the same math as `F.linear(x, dequantize_reference(w))` but for the order of the fp32
additions. Activations stay fp32 (llama.cpp quantizes them to int8; we do not, so that greedy
decoding agrees with the fp32 reference).

The kernel (gguf_matmul.cpp) has two paths: for m <= 4 rows of x (decode) a GEMV that unpacks each
block in registers and reads each weight byte once a call; for larger m (prefill) a tiled GEMM that
dequantizes a few rows at a time into a per-thread fp32 scratch (L1-sized) and runs a register-blocked
micro-kernel over all of x. Both multiply by exactly the reference's fp32 weights. Its inner routines
exist for AVX-512, AVX2 and plain C++ in one portable build; the widest the CPU supports is chosen at
load (`isa()`). `python -m kernels.cpu.gguf_matmul` prints the benchmark against F.linear.

Block formats (ggml, little-endian, 32 weights a block; d and m fp16):
    Q4_0: d, qs[16]     weight j = ((qs[j] & 0xF) - 8) * d, weight j + 16 = ((qs[j] >> 4) - 8) * d
    Q4_1: d, m, qs[16]  weight j = (qs[j] & 0xF) * d + m,   weight j + 16 = (qs[j] >> 4) * d + m
    Q8_0: d, qs[32]     weight j = qs[j] * d (int8)
"""

from __future__ import annotations

import argparse
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from kernels.cpu.build import ISAS, Extension, isa_cap

BLOCK = 32  # weights a block, every format


@dataclass(frozen=True, slots=True)
class _Format:
    code: int  # the extension's QType
    block_bytes: int
    has_offset: bool  # Q4_1's m
    nibbles: bool  # two 4-bit codes a byte (else one int8)
    bias: int  # subtracted from each code (Q4_0: 8)


_FORMATS = {
    "Q4_0": _Format(code=0, block_bytes=18, has_offset=False, nibbles=True, bias=8),
    "Q4_1": _Format(code=1, block_bytes=20, has_offset=True, nibbles=True, bias=0),
    "Q8_0": _Format(code=2, block_bytes=34, has_offset=False, nibbles=False, bias=0),
}
QTYPES = tuple(_FORMATS)


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """A [out_features, in_features] weight in GGUF blocks; checked once, here."""

    data: torch.Tensor  # uint8 [out_features, row_bytes] contiguous, the file's blocks row by row
    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    in_features: int  # a multiple of 32

    def __post_init__(self) -> None:
        fmt = _FORMATS.get(self.qtype)
        if fmt is None:
            raise ValueError(f"GGUFWeight: qtype {self.qtype!r} is not one of {QTYPES}")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"GGUFWeight: in_features {self.in_features} is not a positive multiple of 32")
        d = self.data
        if not isinstance(d, torch.Tensor) or d.dtype != torch.uint8 or d.dim() != 2:
            raise ValueError("GGUFWeight: data must be a 2-d uint8 tensor [out_features, row_bytes]")
        if d.device.type != "cpu" or not d.is_contiguous():
            raise ValueError("GGUFWeight: data must be a contiguous CPU tensor")
        row_bytes = self.in_features // BLOCK * fmt.block_bytes
        if d.shape[1] != row_bytes:
            raise ValueError(
                f"GGUFWeight: {self.qtype} rows of {self.in_features} weights take {row_bytes} bytes, "
                f"data has {d.shape[1]}"
            )

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: str, in_features: int) -> GGUFWeight:
        """From a GGUF tensor's bytes (gguf.GGUFReader's t.data, uint8 [rows, row_bytes]); a
        read-only or strided array (the reader's memory map) is copied, a writable one shared."""
        if data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(
                f"GGUFWeight.from_numpy: need uint8 [rows, row_bytes], got {data.dtype} {data.shape}"
            )
        if not (data.flags.writeable and data.flags.c_contiguous):
            data = np.array(data, order="C", copy=True)
        return cls(torch.from_numpy(data), qtype, in_features)

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The rows `index` (int64 [r]) in that order: a subset or permutation, as a new weight."""
        return GGUFWeight(self.data.index_select(0, index), self.qtype, self.in_features)

    @staticmethod
    def cat(weights: list[GGUFWeight]) -> GGUFWeight:
        """The rows of each weight, one after the other (e.g. q, k, v into one qkv)."""
        if not weights:
            raise ValueError("GGUFWeight.cat: no weights")
        first = weights[0]
        for w in weights[1:]:
            if (w.qtype, w.in_features) != (first.qtype, first.in_features):
                raise ValueError(
                    f"GGUFWeight.cat: {w.qtype} x {w.in_features} does not stack on "
                    f"{first.qtype} x {first.in_features}"
                )
        return GGUFWeight(torch.cat([w.data for w in weights]), first.qtype, first.in_features)


def _apply_isa_cap(ext: ModuleType) -> None:
    cap = isa_cap()
    if cap is not None:  # the widest supported path no wider than the cap
        allowed = ISAS[: ISAS.index(cap) + 1]
        ext.set_isa(next(name for name in ext.supported_isas() if name in allowed))


_EXT = Extension("gguf_matmul", Path(__file__).with_suffix(".cpp"), on_load=_apply_isa_cap)


def available() -> bool:
    """The compiled kernel built (or loaded from the cache) here."""
    return _EXT.available()


_require = _EXT.module


class MatmulPath(enum.IntEnum):
    """The kernel's path (the extension's codes): by default chosen by m; tests and benchmarks force one."""

    AUTO = 0
    GEMV = 1  # registers-only unpacking, reads the blocks once per 4 rows of x (decode)
    TILED = 2  # fp32 tiles of a few rows, register-blocked micro-kernel (prefill)


def gguf_linear(x: torch.Tensor, w: GGUFWeight, *, path: MatmulPath = MatmulPath.AUTO) -> torch.Tensor:
    """x [m, k] fp32 contiguous (CPU) @ w^T -> [m, n] fp32, with n = w.out_features, k = w.in_features."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError("gguf_linear: x must be a 2-d fp32 tensor [m, in_features]")
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("gguf_linear: x must be a contiguous CPU tensor")
    if x.shape[1] != w.in_features:
        raise ValueError(f"gguf_linear: x has {x.shape[1]} features, the weight takes {w.in_features}")
    return _require().linear(x, w.data, _FORMATS[w.qtype].code, int(path))


def bound_linear(w: GGUFWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    """`gguf_linear(x, w)` with w bound and the checks left to the C++ (which raises RuntimeError on
    a wrong x): for the model's per-layer calls, where Python's checks cost as much as the kernel."""
    linear, data, code = _require().linear, w.data, _FORMATS[w.qtype].code

    def call(x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = linear(x, data, code, 0)
        return y

    return call


def gguf_dequantize(w: GGUFWeight) -> torch.Tensor:
    """[n, k] fp32 by the compiled kernel: bit-equal to dequantize_reference, many times faster (an
    embedding lookup dequantizes only its rows: `gguf_dequantize(w.rows(ids))`)."""
    return _require().dequantize(w.data, _FORMATS[w.qtype].code, w.in_features)


def isa() -> str:
    """The ISA path in use: "avx512", "avx2" or "scalar"."""
    return str(_require().isa())


def supported_isas() -> list[str]:
    """The paths this CPU can run, widest first."""
    return [str(s) for s in _require().supported_isas()]


def set_isa(name: str) -> None:
    """Run a narrower path (tests and benchmarks hold every path equal on one machine)."""
    _require().set_isa(name)


def dequantize_reference(w: GGUFWeight) -> torch.Tensor:
    """[n, k] fp32 in plain torch, the arithmetic of gguf.quants.dequantize (d * q, then + m)."""
    fmt = _FORMATS[w.qtype]
    n, nb = w.out_features, w.in_features // BLOCK
    blocks = w.data.view(n, nb, fmt.block_bytes)  # [n, nb, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    qs = blocks[..., 4 if fmt.has_offset else 2 :]
    if fmt.nibbles:  # [n, nb, 16] -> [n, nb, 32]: the low nibbles are weights 0-15
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.int32) - fmt.bias
    else:
        q = qs.contiguous().view(torch.int8)
    out = d * q.float()
    if fmt.has_offset:
        out = out + blocks[..., 2:4].contiguous().view(torch.float16).float()
    return out.reshape(n, w.in_features)


def gguf_linear_reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    return F.linear(x, dequantize_reference(w))


# ---------------------------------------------------------------------------------------------------
# Benchmark: gguf_linear against F.linear on the dequantized fp32 weight, SmolLM2-135M's fused shapes.

BENCH_SHAPES = {  # name: (out_features, in_features)
    "qkv": (576 + 2 * 192, 576),
    "o": (576, 576),
    "gate_up": (2 * 1536, 576),
    "down": (576, 1536),
}


def random_weight(n: int, k: int, qtype: str, seed: int = 0) -> GGUFWeight:
    """[n, k] of random codes with finite fp16 scales (and offsets) of a trained model's size
    (|d|, |m| <= 0.01): for benchmarks."""
    fmt = _FORMATS[qtype]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // BLOCK, fmt.block_bytes), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // BLOCK, 2, generator=g) * 0.02 - 0.01).half()
    head = 4 if fmt.has_offset else 2
    blocks[..., :head] = scales.view(torch.uint8).view(n, k // BLOCK, 4)[..., :head]
    return GGUFWeight(blocks.reshape(n, -1).contiguous(), qtype, k)


def _best_ms_per_call(calls: list[Callable[[], object]], runs: int) -> float:
    """Best of `runs` passes through `calls` (one a layer), in ms a call."""
    for call in calls:
        call()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3 / len(calls)


def bench(
    m_list: tuple[int, ...] = (1, 8, 32, 256), qtype: str = "Q4_1", layers: int = 1, runs: int = 20
) -> list[dict]:
    """gguf_linear against F.linear on the dequantized fp32 weight, for SmolLM2-135M's fused shapes:
    best-of-`runs` ms a call, the weight bytes read a second and the GFLOP/s; threads as
    torch.get_num_threads(). With `layers` > 1 each pass cycles through that many different weights
    (30: the model's depth), so that, as in a real decode step, the fp32 weights come from DRAM."""
    rows = []
    for name, (n, k) in BENCH_SHAPES.items():
        weights = [random_weight(n, k, qtype, seed=i) for i in range(layers)]
        dense = [dequantize_reference(w) for w in weights]
        for m in m_list:
            x = torch.randn(m, k)
            ms_q = _best_ms_per_call([partial(gguf_linear, x, w) for w in weights], runs)
            ms_f = _best_ms_per_call([partial(F.linear, x, d) for d in dense], runs)
            rows.append(
                {
                    "shape": f"{name} [{n}, {k}]",
                    "m": m,
                    "gguf_ms": ms_q,
                    "fp32_ms": ms_f,
                    "speedup": ms_f / ms_q,
                    "gguf_GBps": weights[0].nbytes / ms_q / 1e6,
                    "fp32_GBps": dense[0].numel() * 4 / ms_f / 1e6,
                    "gguf_GFLOPs": 2 * m * n * k / ms_q / 1e6,
                    "fp32_GFLOPs": 2 * m * n * k / ms_f / 1e6,
                }
            )
    return rows


def _print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print(f"{'shape':<22}{'m':>5}{'gguf ms':>10}{'fp32 ms':>10}{'speedup':>9}{'GB/s':>8}{'GFLOP/s':>9}")
    for r in rows:
        print(
            f"{r['shape']:<22}{r['m']:>5}{r['gguf_ms']:>10.4f}{r['fp32_ms']:>10.4f}"
            f"{r['speedup']:>9.2f}{r['gguf_GBps']:>8.1f}{r['gguf_GFLOPs']:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="gguf_linear against F.linear, SmolLM2-135M's shapes")
    parser.add_argument("--isa", choices=("avx512", "avx2", "scalar"), help="a narrower path than the widest")
    if (name := parser.parse_args().isa) is not None:
        set_isa(name)
    print(f"gguf_matmul: isa {isa()} (of {supported_isas()}), {torch.get_num_threads()} threads")
    _print_table("one weight, cache-resident:", bench())
    _print_table("30 layers' weights in turn (fp32 from DRAM):", bench(m_list=(1,), layers=30, runs=10))


if __name__ == "__main__":
    main()
