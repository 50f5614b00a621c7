"""Group-wise KV quantization: round trips within the group's error bound, int4 packing, and the
real bytes per token of each layout."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quant import Dequantizer, key_scale, levels, pack, quantize_keys, quantize_values
from cloud.engine.kv.quantized_cache import QuantizedKVCache


def _keys(h: int = 3, n: int = 5, bs: int = 16, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(h, n, bs, d, generator=g)
    k[..., 7] *= 20  # an outlier channel, as real keys have
    return k


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_round_trip_within_half_a_step_per_channel(bits: int) -> None:
    k = _keys()
    kmin, kmax = k.amin(2).half(), k.amax(2).half()  # per block and channel
    codes = quantize_keys(k, kmin, kmax, bits)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (64 if bits == 8 else 32)
    back = Dequantizer(bits, torch.float32).keys(codes, kmin, kmax)
    step = key_scale(kmin, kmax, bits).float().unsqueeze(2)
    # half a step, plus what fp16 rounding of min and max moves the grid by
    bound = step / 2 + 2e-3 * k.abs().amax(2, keepdim=True)
    assert bool(((back - k).abs() <= bound).all())
    # a finer grid is more accurate: the bound is about the group size, not loose
    assert (back - k).abs().max() > step.amin() / 8


@pytest.mark.parametrize("bits", [8, 4])
def test_values_round_trip_within_half_a_step_per_token(bits: int) -> None:
    v = torch.randn(3, 7, 16, 64, generator=torch.Generator().manual_seed(1)) * 3
    codes, scale, zero = quantize_values(v, bits)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == v.shape[:-1]
    back = Dequantizer(bits, torch.float32).values(codes, scale, zero)
    bound = scale.float().unsqueeze(-1) / 2 + 2e-3 * v.abs().amax(-1, keepdim=True)
    assert bool(((back - v).abs() <= bound).all())


def test_flat_groups_come_back_exactly() -> None:
    v = torch.full((1, 1, 4, 8), 0.5)
    codes, scale, zero = quantize_values(v, 4)
    assert torch.equal(Dequantizer(4, torch.float32).values(codes, scale, zero), v)


def test_int4_packs_two_codes_per_byte_and_unpacks_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # every nibble value, odd and even lanes
    packed = pack(codes.view(1, -1), 4)
    assert packed.shape == (1, 16)
    assert torch.equal(Dequantizer(4, torch.float32).codes(packed), codes.view(1, -1).float())
    assert levels(4) == 15 and levels(8) == 255


def test_int4_cache_takes_under_a_third_of_fp16_bytes_per_token_scales_included() -> None:
    layers, heads, dim = 30, 3, 64  # the default model's shape
    fp16 = KVCache.bytes_per_token(layers, heads, dim, torch.float16)
    int4 = QuantizedKVCache.bytes_per_token(layers, heads, dim, 4, block_size=32)
    int8 = QuantizedKVCache.bytes_per_token(layers, heads, dim, 8, block_size=32)
    assert int4 <= 0.3 * fp16
    assert int4 < int8 < fp16
    # scales count: codes alone would be exactly a quarter
    assert int4 > 0.25 * fp16
