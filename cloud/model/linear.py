"""Weight formats for the model's projections, behind one call `linear(x) -> y`.

A format ("kernel") is dense float32 / bfloat16 / float16, or weight-only int8 / int4. Decode is
bound by reading weights, prefill and large batches by arithmetic, and which kernel wins depends on
the CPU (AMX bf16, AVX-512 fp16, or neither): so a Linear may hold two kernels, one for steps of
few tokens and one for the rest (a `WeightPlan`), and `plan_weights` can pick them by timing the
candidates on this machine. Activations enter and leave in the model's run dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from cloud.model.formats import WeightQuant
from kernels.cpu.gguf_matmul import GGUFWeight, bound_linear, gguf_linear, random_weight
from kernels.cpu.gguf_matmul import available as gguf_available

# gguf: the file's own quantized blocks (Q4_0 / Q4_1 / Q8_0) read by a C++ kernel with fp32
# activations and fp32 accumulation (kernels/cpu/gguf_matmul.py): the float32 reference's math on
# the dequantized weights, in another summation order, at a fifth of the bytes for Q4_1
KernelKind = Literal["float32", "bfloat16", "float16", "int8", "int4", "gguf"]
INT4_GROUP = 32  # the GGUF Q4 block size, so Q4_0 / Q4_1 weights keep their own grouping
# `auto` chooses only among kernels whose greedy output agrees with the float32 reference as well
# as float16 weights do (the precision serving stacks treat as lossless). Measured with SmolLM2-135M,
# 30 chat prompts (10 with a 500-token document) x 64 greedy tokens (`ctxfuse bench agreement`):
# float16 weights kept 27/30 continuations identical; bfloat16 used only for steps of more than 32
# tokens (prefill) and float32 below also kept 27/30; bfloat16 everywhere, int8 and int4 (whose CPU
# kernels round activations and outputs to bfloat16) kept 1-4 of 20 short prompts. So bfloat16 may
# serve prefill-sized steps, never decode-sized ones; int8 and int4 stay explicit choices.
AUTO_SMALL_KERNELS: tuple[KernelKind, ...] = ("float32", "float16")
AUTO_LARGE_KERNELS: tuple[KernelKind, ...] = ("float32", "float16", "bfloat16")
AUTO_SMALL_MAX_TOKENS = 32
AUTO_MARGIN = 0.15
_DENSE: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class Kernel:
    """y = x @ W.T for one weight in one format; x and y in `out_dtype`."""

    def __init__(
        self,
        weight: torch.Tensor,
        kind: KernelKind,
        out_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        blocks: GGUFWeight | None = None,
    ) -> None:
        if kind == "gguf" and (blocks is None or torch.device(device).type != "cpu" or not gguf_available()):
            kind = "float32"  # no blocks for this weight (a float tensor in the file), or no kernel here
        self.kind = kind
        self.out_dtype = out_dtype
        self.in_features = weight.shape[1]
        self.blocks = blocks if kind == "gguf" else None
        self._bound = None if self.blocks is None else bound_linear(self.blocks)
        if kind == "int4" and self.in_features % INT4_GROUP:
            self.kind = kind = "int8"  # no whole groups: per-channel int8 instead
        self.scales = self.scales_zeros = torch.empty(0)
        if kind == "gguf":
            self.compute_dtype = torch.float32
            self.weight = torch.empty(0)  # the blocks are the weight
        elif kind in _DENSE:
            self.compute_dtype = _DENSE[kind]
            self.weight = weight.to(device=device, dtype=self.compute_dtype).contiguous()
        elif torch.device(device).type != "cpu":
            raise ValueError(f"{kind} weights use CPU kernels; on {device} use dense weights")
        elif kind == "int8":
            self.compute_dtype = torch.bfloat16
            self.weight, self.scales = _quantize_int8(weight)
        else:
            self.compute_dtype = torch.bfloat16
            self.weight, self.scales_zeros = _quantize_int4(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, in_features] -> [tokens, out_features]
        if self._bound is not None and x.dtype == torch.float32 == self.out_dtype:
            return self._bound(x.contiguous())  # the fp32 CPU path: no conversions to skip past
        xc = x.to(self.compute_dtype)
        if self.blocks is not None:
            y = gguf_linear(xc.contiguous(), self.blocks)
        elif self.kind in _DENSE:
            y = F.linear(xc, self.weight)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xc, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self.weight, INT4_GROUP, self.scales_zeros)
        return y.to(self.out_dtype)

    @property
    def nbytes(self) -> int:
        held = (self.weight, self.scales, self.scales_zeros)
        return sum(t.numel() * t.element_size() for t in held) + (self.blocks.nbytes if self.blocks else 0)


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """Kernel for steps of at most `small_max_tokens` tokens, and kernel for the rest."""

    small: KernelKind
    large: KernelKind
    small_max_tokens: int = 0

    @classmethod
    def single(cls, kind: KernelKind) -> WeightPlan:
        return cls(kind, kind, 0)

    def describe(self) -> str:
        if self.small == self.large:
            return self.large
        return f"{self.small} for steps of <= {self.small_max_tokens} tokens, {self.large} above"


class Linear:
    """y = x @ W.T (+ b), with the kernel chosen by the number of tokens in x."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        plan: WeightPlan,
        device: torch.device | str = "cpu",
        blocks: GGUFWeight | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.large = Kernel(weight, plan.large, dtype, device, blocks)
        same = plan.small == plan.large
        self.small = self.large if same else Kernel(weight, plan.small, dtype, device, blocks)
        self.small_max_tokens = plan.small_max_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.small if x.shape[0] <= self.small_max_tokens else self.large
        y = kernel(x)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.large.nbytes + (self.small.nbytes if self.small is not self.large else 0)


def plan_weights(
    dtype_name: str,
    weight_quant: WeightQuant,
    shape: tuple[int, int],
    num_layers: int,
    gguf_blocks: str | None = None,
) -> WeightPlan:
    """The weight plan for an engine's options. `auto` times the candidate kernels on this machine
    and keeps the fastest for decode-sized steps (timed over `num_layers` distinct weights of
    `shape`, so that, as in a real step, weights stream from memory: decode is bandwidth-bound) and
    the fastest for prefill-sized steps (compute-bound: a few weights suffice).

    gguf_blocks: the quantized format of the model file's projections (e.g. "Q4_1"), when it has
    one: then `auto` chooses between the GGUF kernel and float32, whose math it shares, and keeps
    the blocks unless float32 is clearly faster (a float copy costs memory for nothing)."""
    if weight_quant == "none":
        return WeightPlan.single(dtype_name)  # type: ignore[arg-type]
    if weight_quant != "auto":
        return WeightPlan.single(weight_quant)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(num_layers)]
    with_gguf: tuple[KernelKind, ...] = ()
    blocks: list[GGUFWeight] = []
    if gguf_blocks is not None and gguf_available():
        with_gguf = ("gguf",)
        blocks = [random_weight(*shape, gguf_blocks, seed=i) for i in range(num_layers)]

    def kernel(w: torch.Tensor, kind: KernelKind, i: int) -> Kernel:
        return Kernel(w, kind, torch.float32, blocks=blocks[i] if kind == "gguf" else None)

    def fastest(kinds: tuple[KernelKind, ...], m: int, ws: list[torch.Tensor]) -> KernelKind:
        kinds = kinds + with_gguf
        cost = {k: _time([kernel(w, k, i) for i, w in enumerate(ws)], m, shape[1]) for k in kinds}
        best = min(kinds, key=cost.__getitem__)
        # the default holds unless another kernel is clearly faster, so the choice does not flip
        # between runs on timing noise: the file's blocks where there are some (the same math as
        # float32, and a float copy of the weights would cost ~4x their memory), else float32
        default: KernelKind = "gguf" if with_gguf else "float32"
        return best if cost[best] < (1 - AUTO_MARGIN) * cost[default] else default

    # with the file's blocks there is an exact fast path: then auto keeps to exact kernels (greedy
    # output identical in kind to the float32 reference's) rather than trading agreement for speed
    small = fastest(("float32",) if with_gguf else AUTO_SMALL_KERNELS, 1, weights)
    large = fastest(("float32",) if with_gguf else AUTO_LARGE_KERNELS, 256, weights[:4])
    return WeightPlan.single(small) if small == large else WeightPlan(small, large, AUTO_SMALL_MAX_TOKENS)


def _time(kernels: list[Kernel], m: int, k: int, reps: int = 3) -> float:
    """Best-of-`reps` seconds for one pass of x [m, k] through every kernel."""
    x = torch.randn(m, k)
    for kern in kernels:
        kern(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for kern in kernels:
            kern(x)
        best = min(best, time.perf_counter() - t)
    return best


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~= q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(torch.bfloat16)  # the kernel wants scales in the activation dtype


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group of 32 inputs): w ~= (q - 8) * scale + zero.

    For weights that came from GGUF Q4_1 (w = d*q + m over blocks of 32) the file's own q is
    recovered, so only the bf16 rounding of scale and zero separates this from the file's values.
    """
    w = w.float()
    out, inp = w.shape
    g = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out, inp)
    zero = lo + 8.0 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros
