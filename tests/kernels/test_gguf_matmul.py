"""The GGUF weight kernels (kernels/cpu/gguf_matmul) against their references: dequantize_reference
against gguf.quants.dequantize (bit-equal), the compiled dequantization against dequantize_reference
(bit-equal), and gguf_linear against F.linear on the dequantized weight, on every ISA path this CPU
can run and on both the GEMV and the tiled path, on random blocks and on the model file's tensors.

Tolerance: every path multiplies by exactly the reference's fp32 weights and differs from F.linear
only in the order of the fp32 additions, so each output may differ by a few ulps of the sum of the
magnitudes of its terms: |y - ref| <= 1e-5 * (|x| @ |W|^T) (the worst case of a k-term fp32 sum is
k * 2^-24 * that, 1e-4 at k = 1536; the typical one, sqrt(k) * 2^-24, is 30x under the bound)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.gguf_matmul import (
    QTYPES,
    GGUFWeight,
    MatmulPath,
    available,
    dequantize_reference,
    gguf_dequantize,
    gguf_linear,
    gguf_linear_reference,
    isa,
    set_isa,
    supported_isas,
)

pytestmark = pytest.mark.skipif(not available(), reason="the C++ extension gguf_matmul did not build here")

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
SCALE_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # d, or d and m, at the head of each block
PATHS = (MatmulPath.AUTO, MatmulPath.GEMV, MatmulPath.TILED)


def random_weight(n: int, k: int, qtype: str, seed: int, full_range: bool = False) -> GGUFWeight:
    """Random codes; d (and m) random finite fp16: of a trained model's size, or (full_range) any
    finite bit pattern, subnormals and +-65504 included."""
    g = torch.Generator().manual_seed(seed)
    nb, head = k // 32, SCALE_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, nb, BLOCK_BYTES[qtype]), generator=g, dtype=torch.uint8)
    if full_range:
        bits = torch.randint(0, 1 << 16, (n, nb, head // 2), generator=g, dtype=torch.int32)
        bits = torch.where((bits & 0x7C00) == 0x7C00, bits & ~0x4000, bits)  # no inf, no nan
        scales = bits.to(torch.int16).view(torch.uint8)
    else:
        scales = (torch.randn(n, nb, head // 2, generator=g) * 0.01).half().view(torch.uint8)
    blocks[..., :head] = scales.reshape(n, nb, head)
    return GGUFWeight(blocks.reshape(n, -1).contiguous(), qtype, k)


def gguf_dequantize_numpy(w: GGUFWeight) -> torch.Tensor:
    out = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[w.qtype])
    return torch.from_numpy(np.ascontiguousarray(out))


def assert_every_path_matches(x: torch.Tensor, w: GGUFWeight, dense: torch.Tensor) -> None:
    """gguf_linear(x, w) on each path within the module's tolerance of F.linear(x, dense)."""
    expected = F.linear(x, dense)
    bound = 1e-5 * F.linear(x.abs(), dense.abs())  # [m, n]: the magnitude of each output's terms
    for path in PATHS:
        y = gguf_linear(x, w, path=path)
        assert y.shape == expected.shape and y.dtype == torch.float32
        err = (y - expected).abs()
        assert (err <= bound).all(), f"{path.name}: off by {err.max()} (bound {bound.max()})"


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA path this CPU runs, put back to the widest afterwards."""
    name = request.param
    if name not in supported_isas():
        pytest.skip(f"this CPU cannot run the {name} path")
    widest = supported_isas()[0]
    set_isa(name)
    try:
        yield name
    finally:
        set_isa(widest)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [32, 576])
def test_dequantize_reference_equals_gguf_bit_for_bit(qtype: str, k: int) -> None:
    for full_range in (False, True):
        w = random_weight(7, k, qtype, seed=k, full_range=full_range)
        assert torch.equal(dequantize_reference(w), gguf_dequantize_numpy(w))


@pytest.mark.parametrize("qtype", QTYPES)
def test_compiled_dequantize_equals_reference_bit_for_bit(isa_path: str, qtype: str) -> None:
    assert isa() == isa_path
    for n, k in [(1, 32), (33, 576), (17, 1536)]:
        w = random_weight(n, k, qtype, seed=n, full_range=True)
        assert torch.equal(gguf_dequantize(w), dequantize_reference(w))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("n", [1, 7, 64, 577])
def test_linear_matches_reference_on_every_path(isa_path: str, qtype: str, k: int, n: int) -> None:
    w = random_weight(n, k, qtype, seed=n * k)
    dense = dequantize_reference(w)
    g = torch.Generator().manual_seed(n + k)
    for m in (1, 3, 17, 64):
        assert_every_path_matches(torch.randn(m, k, generator=g), w, dense)


def test_rows_of_x_across_group_and_block_edges() -> None:
    # both paths take x 4 rows at a time (5-8 rows: a full and a partial group); the tiled path also
    # passes over x 128 rows at a time and over k in chunks of at most 640 (1536: three)
    for k in (576, 1536):
        w = random_weight(45, k, "Q4_1", seed=k)
        dense = dequantize_reference(w)
        for m in (2, 4, 5, 6, 7, 8, 133):
            assert_every_path_matches(torch.randn(m, k), w, dense)


def test_reference_linear_is_f_linear_on_the_dequantized_weight() -> None:
    w = random_weight(9, 64, "Q4_0", seed=1)
    x = torch.randn(2, 64)
    assert torch.equal(gguf_linear_reference(x, w), F.linear(x, gguf_dequantize_numpy(w)))


def test_no_rows_of_x_give_an_empty_result() -> None:
    w = random_weight(5, 64, "Q8_0", seed=2)
    assert gguf_linear(torch.empty(0, 64), w).shape == (0, 5)


@pytest.fixture(scope="module")
def model_tensors(gguf_path: Path) -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(gguf_path)
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"])
def test_model_tensors_match_gguf_and_the_reference(model_tensors: dict, name: str) -> None:
    t = model_tensors[name]
    qtype = t.tensor_type.name
    assert qtype in ("Q4_1", "Q8_0")  # the default model: Q4_1 layers, a Q8_0 embedding
    rows = t.data[:96]  # a few rows keep the test fast
    w = GGUFWeight.from_numpy(rows, qtype, in_features=int(t.shape[0]))
    expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(rows, t.tensor_type)))
    assert torch.equal(dequantize_reference(w), expected)
    assert torch.equal(gguf_dequantize(w), expected)
    for m in (1, 5):
        assert_every_path_matches(torch.randn(m, w.in_features), w, expected)


def test_from_numpy_copies_a_read_only_map_and_shares_a_writable_array() -> None:
    data = random_weight(3, 64, "Q4_1", seed=4).data.numpy().copy()
    shared = GGUFWeight.from_numpy(data, "Q4_1", 64)
    assert np.shares_memory(shared.data.numpy(), data)
    data.flags.writeable = False
    copied = GGUFWeight.from_numpy(data, "Q4_1", 64)
    assert not np.shares_memory(copied.data.numpy(), data)
    assert torch.equal(copied.data, shared.data)
    assert (copied.out_features, copied.nbytes) == (3, 3 * 40)


def test_rows_selects_and_permutes_and_cat_stacks() -> None:
    q = random_weight(6, 64, "Q4_1", seed=5)
    k = random_weight(2, 64, "Q4_1", seed=6)
    perm = torch.tensor([5, 0, 3, 1])
    picked = q.rows(perm)
    assert picked.out_features == 4
    assert torch.equal(dequantize_reference(picked), dequantize_reference(q)[perm])
    qk = GGUFWeight.cat([q, k])
    assert qk.out_features == 8
    assert torch.equal(
        dequantize_reference(qk), torch.cat([dequantize_reference(q), dequantize_reference(k)])
    )
    x = torch.randn(3, 64)
    torch.testing.assert_close(gguf_linear(x, qk), torch.cat([gguf_linear(x, q), gguf_linear(x, k)], dim=1))


def test_bad_weights_are_refused() -> None:
    good = random_weight(2, 64, "Q4_1", seed=7)
    with pytest.raises(ValueError, match="qtype"):
        GGUFWeight(good.data, "Q5_K", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        GGUFWeight(good.data, "Q4_1", 48)
    with pytest.raises(ValueError, match="bytes"):
        GGUFWeight(good.data, "Q8_0", 64)
    with pytest.raises(ValueError, match="uint8"):
        GGUFWeight(good.data.to(torch.int8), "Q4_1", 64)
    with pytest.raises(ValueError, match="contiguous"):
        GGUFWeight(torch.zeros(40, 2, dtype=torch.uint8).t(), "Q4_1", 64)
    with pytest.raises(ValueError, match="uint8"):
        GGUFWeight.from_numpy(np.zeros((2, 40), dtype=np.int8), "Q4_1", 64)
    with pytest.raises(ValueError, match="stack"):
        GGUFWeight.cat([good, random_weight(2, 64, "Q4_0", seed=8)])
    with pytest.raises(ValueError, match="no weights"):
        GGUFWeight.cat([])


def test_bad_activations_are_refused() -> None:
    w = random_weight(2, 64, "Q4_1", seed=9)
    with pytest.raises(ValueError, match="fp32"):
        gguf_linear(torch.randn(1, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="2-d"):
        gguf_linear(torch.randn(64), w)
    with pytest.raises(ValueError, match="contiguous"):
        gguf_linear(torch.randn(64, 2).t(), w)
    with pytest.raises(ValueError, match="features"):
        gguf_linear(torch.randn(1, 32), w)


def test_isa_paths_widest_first_and_unknown_refused() -> None:
    paths = supported_isas()
    assert paths[-1] == "scalar" and isa() == paths[0]
    with pytest.raises(RuntimeError, match="no ISA path"):
        set_isa("neon")


def test_result_does_not_depend_on_the_thread_count() -> None:
    # threads split whole output rows (or tiles of them): every sum is formed the same way
    w = random_weight(200, 576, "Q4_1", seed=10)
    threads = torch.get_num_threads()
    for m in (1, 9):
        x = torch.randn(m, 576)
        many = gguf_linear(x, w)
        torch.set_num_threads(1)
        try:
            one = gguf_linear(x, w)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, many)
