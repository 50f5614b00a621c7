"""Weight formats: each kernel multiplies by (nearly) the weight it was given, GGUF Q4_1 weights
survive int4 packing with their own 4-bit values, and a Linear picks its kernel by step size."""

from __future__ import annotations

import pytest
import torch

from cloud.model.linear import (
    AUTO_LARGE_KERNELS,
    AUTO_SMALL_KERNELS,
    AUTO_SMALL_MAX_TOKENS,
    INT4_GROUP,
    Kernel,
    Linear,
    WeightPlan,
    plan_weights,
)


def q4_1_like(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Weights as GGUF Q4_1 stores them: w = d * q + m per block of 32, q in 0..15 using both ends."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, inp // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # the block's min and max, as the quantizer always produces
    d = (torch.rand(out, inp // INT4_GROUP, 1, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(out, inp // INT4_GROUP, 1, generator=g) * 0.08).half().float()
    return (q * d + m).reshape(out, inp)


@pytest.mark.parametrize(
    ("kind", "tol"),
    [("float32", 1e-6), ("float16", 3e-3), ("bfloat16", 2e-2), ("int8", 5e-2), ("int4", 2e-2)],
)
def test_kernel_multiplies_by_its_weight(kind: str, tol: float) -> None:
    w = q4_1_like(96, 128)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    want = x.double() @ w.double().t()
    got = Kernel(w, kind, torch.float32)(x)  # type: ignore[arg-type]
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert rel < tol, f"{kind}: relative error {rel}"


def test_int4_keeps_q4_1_values_up_to_bf16_scales() -> None:
    w = q4_1_like(64, 256)
    k = Kernel(w, "int4", torch.float32)
    eye = torch.eye(256)
    recovered = k(eye).t()  # column j of the identity picks input j: the effective weight
    # only the bf16 rounding of scale and zero remains (~2^-8 of a block's range)
    err = (recovered - w).abs().max().item()
    assert err < 2e-3, err
    assert k.nbytes < w.numel() * 4 / 6  # 4-bit values plus group scales: far below fp32


def test_int4_falls_back_to_int8_without_whole_groups() -> None:
    assert Kernel(torch.randn(8, 40), "int4", torch.float32).kind == "int8"


def test_linear_uses_the_small_kernel_up_to_its_limit() -> None:
    w = torch.randn(64, 64)
    lin = Linear(w, None, torch.float32, WeightPlan("float32", "bfloat16", 4))
    x = torch.randn(8, 64)
    assert torch.equal(lin(x[:4]), lin.small(x[:4]))
    assert torch.equal(lin(x), lin.large(x))
    assert not torch.equal(lin(x)[:4], lin(x[:4]))  # the two formats really differ


def test_explicit_options_pin_one_kernel() -> None:
    assert plan_weights("float32", "none", (64, 64), 2) == WeightPlan.single("float32")
    assert plan_weights("bfloat16", "none", (64, 64), 2) == WeightPlan.single("bfloat16")
    assert plan_weights("float32", "int4", (64, 64), 2) == WeightPlan.single("int4")


def test_auto_chooses_only_kernels_that_agree_with_the_reference() -> None:
    plan = plan_weights("float32", "auto", (256, 128), 4)
    assert plan.small in AUTO_SMALL_KERNELS and plan.large in AUTO_LARGE_KERNELS
    if plan.small != plan.large:
        assert plan.small_max_tokens == AUTO_SMALL_MAX_TOKENS
    # decode-sized steps never run on kernels that round activations to bfloat16
    assert "bfloat16" not in AUTO_SMALL_KERNELS and "int4" not in AUTO_SMALL_KERNELS
