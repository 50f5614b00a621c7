"""RMSNorm (with and without the residual add) and the in-place rotary embedding against their PyTorch
references, the engine's `_norm` and `RotaryEmbedding.apply` (under TRITON_INTERPRET=1 on the CPU).

Under the interpreter an fp32 -> 16-bit cast truncates where PyTorch rounds to nearest: 16-bit results
are compared within an ulp or two, measured against the larger magnitude."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cloud.model.config import ModelConfig
from cloud.model.llama import LlamaModel
from cloud.model.rope import RotaryEmbedding
from kernels.triton.norm_rope import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rope_apply_,
    rope_apply_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    """fp32: within 1e-5; 16-bit: |a - e| <= ulps * eps * max(|a|, |e|) (one ulp of a value v is at
    most eps * |v|)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    a, e = actual.float().cpu(), expected.float().cpu()
    bound = ulps * torch.finfo(actual.dtype).eps * torch.maximum(a.abs(), e.abs())
    worst = ((a - e).abs() - bound).max()
    assert worst <= 0, f"off by more than {ulps} ulp: {(a - e).abs().max()}"


def engine_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LlamaModel._norm itself, on a stand-in for the model (it reads only config.rms_eps, dtype)."""
    model = SimpleNamespace(config=SimpleNamespace(rms_eps=EPS), dtype=x.dtype)
    return LlamaModel._norm(model, x, weight)  # type: ignore[arg-type]


def rows(shape: tuple[int, int], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_reference_and_engine(hidden: int, dtype: torch.dtype) -> None:
    # x a row-strided view (a slice of a wider tensor); weight fp32 as the engine keeps it
    x = rows((7, hidden + 64), dtype, 1, scale=3.0)[:, :hidden]
    w = rows((1, hidden), torch.float32, 2).view(hidden) + 1
    out = rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_ulps(out, rms_norm_reference(x, w, EPS), 1)
    assert_ulps(out, engine_norm(x, w).to(DEVICE), 1)


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize(
    ("dtype", "res_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_fused_add_rms_norm(hidden: int, dtype: torch.dtype, res_dtype: torch.dtype) -> None:
    x, residual = rows((5, hidden), dtype, 3), rows((5, hidden), res_dtype, 4, scale=4.0)
    w = rows((1, hidden), torch.bfloat16, 5).view(hidden)  # any float weight is read as fp32
    x_before, res_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, w, EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs untouched
    assert normed.dtype == dtype and new_residual.dtype == res_dtype
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, w, EPS)
    assert_ulps(new_residual, ref_residual, 1)
    # the norm of the residual as stored is exact to an ulp; an ulp off in the residual adds one more
    assert_ulps(normed, fused_add_rms_norm_reference(torch.zeros_like(x), new_residual, w, EPS)[0], 1)
    assert_ulps(normed, ref_normed, 2)
    if dtype == res_dtype:  # the engine's layer: h = h + o; x = _norm(h, ffn_norm)
        h = residual + x
        assert_ulps(new_residual, h, 1)
        assert_ulps(normed, engine_norm(h, w.float()), 2)


def small_config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        num_layers=1,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=32,
        max_position=512,
        rope_theta=10000.0,
        rms_eps=EPS,
        tie_embeddings=True,
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [(9, 3, 64, torch.float32), (9, 3, 64, torch.bfloat16), (32, 8, 128, torch.float16)],
)
def test_rope_in_place_equals_rotary_embedding(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """As the model calls it: qk a view of the fused qkv projection's q and k heads, the tables from
    RotaryEmbedding.tables ([T, 1, d]); v must stay untouched."""
    t, d = 5, head_dim
    rope = RotaryEmbedding(small_config(heads, kv_heads, d), 512, dtype)
    positions = torch.tensor([0, 1, 17, 300, 511])
    cos, sin = (tab.to(DEVICE) for tab in rope.tables(positions))
    qkv = rows((t, (heads + 2 * kv_heads) * d), dtype, 6, scale=2.0)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    before = qkv.clone()
    expected = RotaryEmbedding.apply(qk.cpu(), cos.cpu(), sin.cpu())
    ours = rope_apply_reference(qk, cos, sin)
    assert rope_apply_(qk, cos, sin) is qk
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])
    assert_ulps(qk, ours, 1)
    if dtype == torch.float32:
        torch.testing.assert_close(qk.cpu(), expected, atol=1e-5, rtol=1e-5)
    else:  # PyTorch rounds both products to 16 bits before the sum: allow an ulp of each term
        x = before[:, : (heads + kv_heads) * d].view(t, -1, d).float().cpu()
        terms = x.abs() * cos.float().cpu().abs() + x.roll(d // 2, -1).abs() * sin.float().cpu().abs()
        bound = 2 * torch.finfo(dtype).eps * terms
        assert ((qk.float().cpu() - expected.float()).abs() <= bound).all()


def test_rope_plain_tables_and_odd_token_count() -> None:
    """cos / sin given as [T, d] with halves that differ: both halves are read as they are."""
    qk = rows((3 * 4, 64), torch.float32, 7).view(3, 4, 64)
    cos, sin = rows((3, 64), torch.float32, 8), rows((3, 64), torch.float32, 9)
    expected = RotaryEmbedding.apply(qk.cpu(), cos.cpu()[:, None], sin.cpu()[:, None])
    torch.testing.assert_close(rope_apply_(qk, cos, sin).cpu(), expected, atol=1e-5, rtol=1e-5)


def test_refuses_bad_input() -> None:
    x, w = rows((3, 64), torch.float32, 0), torch.ones(64, device=DEVICE)
    qk, tab = rows((3 * 2, 64), torch.float32, 1).view(3, 2, 64), rows((3, 64), torch.float32, 2)
    with pytest.raises(ValueError, match="2 dimensions"):
        rms_norm(x[0], w, EPS)
    with pytest.raises(ValueError, match="shape mismatch"):
        rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        rms_norm(x.double(), w, EPS)
    with pytest.raises(ValueError, match="contiguous last"):
        rms_norm(rows((3, 128), torch.float32, 0)[:, ::2], w, EPS)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="one device"):
        fused_add_rms_norm(x, x.to("meta"), w, EPS)
    with pytest.raises(ValueError, match="3 dimensions"):
        rope_apply_(qk[0], tab, tab)
    with pytest.raises(ValueError, match="rope_apply_ wants"):
        rope_apply_(qk, tab[:2], tab)
    with pytest.raises(ValueError, match="rope_apply_ wants"):
        rope_apply_(qk[..., :63], tab[:, :63], tab[:, :63])  # odd head dim
    with pytest.raises(ValueError, match="contiguous last"):
        rope_apply_(rows((3 * 2, 128), torch.float32, 3).view(3, 2, 128)[..., ::2], tab, tab)
