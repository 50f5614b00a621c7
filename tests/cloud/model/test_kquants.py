"""GGUF K-quant (and 5-bit, Q8_0) blocks decoded in torch equal the gguf package's numpy decoders
bit for bit on random blocks of every type (real tensors of the Gemma 3 file are held to the same in
tests/cloud/engine/test_gemma3_engine.py, which opens the file once); Q8_K, which the gguf package
cannot decode, against its layout spelled out in numpy. The loader refuses what it cannot decode,
by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud.model import kquants
from cloud.model.gguf_loader import _dequantize
from shared.errors import ModelLoadError

# where each type keeps its fp16 factors (byte offsets): set to finite values in random blocks, so
# that both decoders multiply numbers (NaN * x has no bit pattern to compare)
_FACTORS = {
    "Q8_0": (0,),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _random_blocks(qtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    _, size, _ = kquants.KQUANTS[qtype]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _FACTORS[qtype]:
        raw[:, at : at + 2] = rng.normal(0, 0.05, (n, 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", sorted(_FACTORS))
def test_random_blocks_decode_as_the_gguf_reference(qtype: str) -> None:
    import gguf

    raw = _random_blocks(qtype, 64, np.random.default_rng(hash(qtype) % 2**32))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(-1)
    got = kquants.dequantize(torch.from_numpy(raw), qtype, want.size).numpy()
    np.testing.assert_array_equal(got, want)


def test_q8_k_blocks_are_fp32_scale_times_int8_codes() -> None:
    rng = np.random.default_rng(1)
    n = 8
    d = rng.normal(0, 0.01, n).astype(np.float32)
    q = rng.integers(-128, 128, (n, 256), dtype=np.int8)
    sums = q.reshape(n, 16, 16).sum(-1).astype(np.int16)  # only dot products read them
    raw = np.concatenate([d.view(np.uint8).reshape(n, 4), q.view(np.uint8), sums.view(np.uint8)], axis=1)
    got = kquants.dequantize(torch.from_numpy(raw), "Q8_K", n * 256).numpy()
    np.testing.assert_array_equal(got, (d[:, None] * q.astype(np.float32)).reshape(-1))


def test_a_partial_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not 512 Q4_K weights"):
        kquants.dequantize(torch.zeros(144 + 1, dtype=torch.uint8), "Q4_K", 512)


def test_an_unknown_tensor_type_is_refused_by_name() -> None:
    import gguf

    class Tensor:  # what the loader reads of a reader's tensor, claiming a type we cannot decode
        name = "blk.0.ffn_up.weight"
        tensor_type = gguf.GGMLQuantizationType.IQ2_XXS
        data = np.zeros((4, 66), dtype=np.uint8)
        shape = (256, 4)

    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight has unsupported type IQ2_XXS"):
        _dequantize(Tensor)
