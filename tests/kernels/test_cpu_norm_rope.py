"""The CPU forward's fused small ops (kernels/cpu/norm_rope.py) against their PyTorch references
(kernels/triton/norm_rope.py *_reference), on the default model's shapes, a decode row and a
prefill-sized batch (threaded), and strided views as the forward passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import norm_rope
from kernels.triton.norm_rope import fused_add_rms_norm_reference, rms_norm_reference, rope_apply_reference

pytestmark = pytest.mark.skipif(not norm_rope.available(), reason="the C++ extension cannot be built here")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_norms_match_the_reference(rows: int) -> None:
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
def test_silu_mul_matches_the_reference(rows: int) -> None:
    gu = torch.randn(rows, 2 * INTER, generator=torch.Generator().manual_seed(3)) * 4
    want = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    torch.testing.assert_close(norm_rope.silu_mul(gu), want, rtol=1e-5, atol=1e-5)


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
