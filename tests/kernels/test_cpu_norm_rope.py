"""The CPU forward's fused small ops (kernels/cpu/norm_rope.py) against their PyTorch references
(kernels/triton/norm_rope.py *_reference), on the default model's shapes, a decode row and a
prefill-sized batch (threaded), and strided views as the forward passes them; the norms and SiLU on
every vector path this CPU runs (scalar, AVX2, AVX-512)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import norm_rope
from kernels.triton.norm_rope import fused_add_rms_norm_reference, rms_norm_reference, rope_apply_reference

pytestmark = pytest.mark.skipif(not norm_rope.available(), reason="the C++ extension cannot be built here")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
ISAS = norm_rope.supported_isas() if norm_rope.available() else []


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    before = norm_rope.isa()
    norm_rope.set_isa(request.param)
    yield request.param
    norm_rope.set_isa(before)


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_norms_match_the_reference(rows: int, isa: str) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g) * 3
    h = torch.randn(rows, HIDDEN, generator=g)
    w = torch.randn(HIDDEN, generator=g)
    torch.testing.assert_close(
        norm_rope.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )
    want_x, want_h = fused_add_rms_norm_reference(x, h, w, 1e-5)
    got_x, got_h = norm_rope.fused_add_rms_norm(x, h, w, 1e-5)
    assert got_h is h  # the residual is updated in place
    assert torch.equal(got_h, want_h)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 100])
def test_rope_in_place_matches_the_reference_on_a_strided_view(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    v_before = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].clone()
    angles = torch.arange(rows).double()[:, None] * (
        1e5 ** (-torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    )
    cos = torch.cat([angles.cos()] * 2, -1).float()
    sin = torch.cat([angles.sin()] * 2, -1).float()
    want = rope_apply_reference(qk, cos, sin)
    assert norm_rope.rope_apply_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, want, rtol=0, atol=1e-6)
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :], v_before)  # v untouched


@pytest.mark.parametrize("rows", [1, 100])
def test_silu_mul_matches_the_reference(rows: int, isa: str) -> None:
    gu = torch.randn(rows, 2 * INTER, generator=torch.Generator().manual_seed(3)) * 4
    want = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    torch.testing.assert_close(norm_rope.silu_mul(gu), want, rtol=1e-5, atol=1e-5)


def test_silu_mul_at_the_edges_of_exp(isa: str) -> None:
    """Gates far past exp's range and NaN, in the vector body and the scalar tail (an infinite gate
    is left out: PyTorch gives NaN for -inf, the vector path -inf, neither a number a model uses)."""
    gate = torch.tensor([-1e4, -100.0, -88.5, -87.0, -1e-3, 0.0, 87.0, 88.5, 100.0, 3e38])
    gate = torch.cat([gate, torch.tensor([float("nan"), 1.5]), gate])  # 22: a tail on every path
    up = torch.linspace(-2, 3, gate.numel())
    got = norm_rope.silu_mul(torch.cat([gate, up])[None])
    want = F.silu(gate) * up
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-30, equal_nan=True)


def test_an_isa_this_cpu_lacks_is_refused() -> None:
    missing = [name for name in ("scalar", "avx2", "avx512") if name not in ISAS]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(ValueError, match="not available"):
        norm_rope.set_isa(missing[0])


def test_wrong_inputs_are_refused() -> None:
    x = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError, match="float32"):
        norm_rope.rms_norm(x.double(), torch.ones(HIDDEN), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        norm_rope.rms_norm(x, torch.ones(HIDDEN + 1), 1e-5)
    with pytest.raises(RuntimeError, match="one shape"):
        norm_rope.fused_add_rms_norm(x, torch.randn(3, HIDDEN), torch.ones(HIDDEN), 1e-5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        norm_rope.rope_apply_(torch.randn(2, 4, 64), torch.randn(3, 64), torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="side by side"):
        norm_rope.silu_mul(torch.randn(2, 7))
