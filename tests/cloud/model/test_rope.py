"""RoPE scaling (linear, dynamic NTK, YaRN, llama3) against transformers' own ROPE_INIT_FUNCTIONS:
the frequencies agree to fp32 rounding and the attention factor exactly, from a dict, a config.json
or GGUF metadata. No model is loaded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cloud.model.config import ModelConfig
from cloud.model.gguf_loader import read_config
from cloud.model.hf_loader import read_hf_config
from cloud.model.rope import RotaryEmbedding, rope_parameters, scaled_context, with_rope_scaling
from shared.errors import ModelLoadError

transformers.logging.set_verbosity_error()  # its validators warn about keys they do not read

FP32 = {"rtol": 2.0**-23, "atol": 0.0}  # one rounding of an fp32 value
HEADS = 4


def model_config(
    scaling: dict[str, Any],
    *,
    max_position: int = 4096,
    head_dim: int = 64,
    theta: float = 10000.0,
    freq_factors: tuple[float, ...] = (),
) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        num_layers=1,
        hidden_size=head_dim * HEADS,
        intermediate_size=8,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=head_dim,
        vocab_size=16,
        max_position=max_position,
        rope_theta=theta,
        rms_eps=1e-5,
        tie_embeddings=True,
        rope_scaling=dict(scaling),
        rope_freq_factors=freq_factors,
    )


def hf_config(scaling: dict[str, Any], *, max_position: int, head_dim: int, theta: float) -> Any:
    params = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    if params.get("rope_type") == "none":  # our spelling of transformers' "default"
        params["rope_type"] = "default"
    return transformers.LlamaConfig(
        hidden_size=head_dim * HEADS,
        num_attention_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters={"rope_theta": theta, **params},
    )


def reference(hf: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf
        )
    inv, factor = ROPE_INIT_FUNCTIONS[kind](hf, None, seq_len=seq_len)
    return inv, float(factor)


QWEN = {"max_position": 32768, "head_dim": 128, "theta": 1e6}  # Qwen2.5-7B's shape
LLAMA3 = {"max_position": 131072, "head_dim": 128, "theta": 500000.0}  # Llama 3.1-8B's shape
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("none", {"type": "none"}, {}),
    ("default", {"rope_type": "default"}, {"theta": 500000.0}),
    ("linear-2", {"type": "linear", "factor": 2.0}, {}),
    ("linear-8", {"rope_type": "linear", "factor": 8}, {"head_dim": 128}),
    ("dynamic", {"type": "dynamic", "factor": 4.0}, {}),
    ("yarn-2", {"type": "yarn", "factor": 2.0}, {}),
    ("yarn-4-qwen", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, QWEN),
    ("yarn-16-betas", {"type": "yarn", "factor": 16.0, "beta_fast": 8, "beta_slow": 2}, {"theta": 500000.0}),
    ("yarn-8-no-truncate", {"type": "yarn", "factor": 8.0, "truncate": False}, {}),
    ("yarn-attention-factor", {"type": "yarn", "factor": 4.0, "attention_factor": 0.8}, {}),
    ("yarn-mscale-deepseek", {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                              "mscale": 0.707, "mscale_all_dim": 1.0}, {"max_position": 163840}),
    ("yarn-mscale-equal", {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0}, {"max_position": 163840}),
    ("yarn-factor-from-lengths", {"type": "yarn", "original_max_position_embeddings": 4096,
                                  "factor": None}, {"max_position": 16384}),
    ("llama3.1", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}, LLAMA3),
    ("llama3.2", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}, {**LLAMA3, "head_dim": 64}),
]  # fmt: skip


@pytest.mark.parametrize(("scaling", "shape"), [(s, k) for _, s, k in CASES], ids=[c[0] for c in CASES])
def test_frequencies_and_attention_factor_match_transformers(
    scaling: dict[str, Any], shape: dict[str, Any]
) -> None:
    ours = rope_parameters(model_config({k: v for k, v in scaling.items() if v is not None}, **shape))
    inv, factor = reference(
        hf_config(scaling, **{"max_position": 4096, "head_dim": 64, "theta": 1e4, **shape})
    )
    assert ours.inv_freq.dtype == torch.float32 and ours.inv_freq.shape == inv.shape
    torch.testing.assert_close(ours.inv_freq, inv, **FP32)
    assert ours.attention_factor == factor


@pytest.mark.parametrize("seq_len", [100, 4096, 4097, 10000, 16384, 131072])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_dynamic_ntk_matches_transformers_below_and_above_the_original_context(
    seq_len: int, factor: float
) -> None:
    scaling = {"type": "dynamic", "factor": factor}
    ours = rope_parameters(model_config(scaling), seq_len=seq_len)
    inv, _ = reference(hf_config(scaling, max_position=4096, head_dim=64, theta=1e4), seq_len=seq_len)
    torch.testing.assert_close(ours.inv_freq, inv, **FP32)
    unscaled = rope_parameters(model_config({})).inv_freq
    assert torch.equal(ours.inv_freq, unscaled) == (seq_len <= 4096)


def test_tables_carry_the_attention_factor_as_transformers_applies_it() -> None:
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = model_config(scaling, **QWEN)
    rope = RotaryEmbedding(config, 256, torch.float64)
    factor = 0.1 * math.log(4.0) + 1.0
    assert rope.attention_factor == pytest.approx(factor)
    assert torch.equal(rope.cos[0], torch.full((128,), factor, dtype=torch.float64))
    torch.testing.assert_close(rope.cos**2 + rope.sin**2, torch.full_like(rope.cos, factor**2))
    # transformers' module: fp32 angles, so agreement to their rounding at these positions
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config(scaling, **QWEN))
    positions = torch.arange(256)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(rope.cos.float(), cos[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(rope.sin.float(), sin[0], rtol=0, atol=2e-5)
    tcos, tsin = rope.tables(torch.tensor([0, 255]))
    assert tcos.shape == tsin.shape == (2, 1, 128)


def test_dynamic_tables_use_the_engine_length_for_every_position() -> None:
    scaling = {"type": "dynamic", "factor": 4.0}
    rope = RotaryEmbedding(model_config(scaling), 16384, torch.float64)
    inv, _ = reference(hf_config(scaling, max_position=4096, head_dim=64, theta=1e4), seq_len=16384)
    for position in (1, 4000, 16383):
        expected = (position * inv.double()).cos()
        torch.testing.assert_close(rope.cos[position, :32], expected, rtol=0, atol=1e-9)


def test_gguf_frequency_factors_reproduce_llama3() -> None:
    scaling = dict(CASES[-2][1])
    inv, _ = reference(hf_config(scaling, **LLAMA3))
    ours = rope_parameters(model_config({}, **LLAMA3, freq_factors=llama_cpp_freq_factors(scaling, 128)))
    torch.testing.assert_close(ours.inv_freq, inv, rtol=1e-6, atol=0.0)


def llama_cpp_freq_factors(scaling: dict[str, Any], head_dim: int) -> tuple[float, ...]:
    """What llama.cpp's converter writes as rope_freqs for llama3 scaling: a divisor per frequency."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(float(np.float32(f)) for f in out)


@pytest.mark.parametrize(
    ("scaling", "shape", "expected"),
    [
        ({}, {}, 4096),
        ({"type": "linear", "factor": 4.0}, {}, 16384),
        ({"type": "dynamic", "factor": 2.0}, {}, 8192),
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, QWEN, 131072),
        (
            {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096},
            {"max_position": 163840},
            163840,
        ),
        (
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
            {"max_position": 32768},
            32768,
        ),
        (CASES[-2][1], LLAMA3, 131072),  # Llama 3.1 states its scaled context
        ({**CASES[-2][1], "original_max_position_embeddings": 4096}, {"max_position": 4096}, 32768),
    ],
)
def test_scaled_context(scaling: dict[str, Any], shape: dict[str, Any], expected: int) -> None:
    assert scaled_context(model_config(scaling, **shape)) == expected


def test_user_override_replaces_the_models_scaling_in_a_copy() -> None:
    base = model_config({}, **LLAMA3, freq_factors=(2.0,) * 64)
    scaled = with_rope_scaling(base, {"rope_type": "yarn", "factor": 4})
    assert scaled.rope_scaling == {"rope_type": "yarn", "factor": 4} and scaled.rope_freq_factors == ()
    assert base.rope_scaling == {} and base.rope_freq_factors == (2.0,) * 64
    assert scaled_context(scaled) == 4 * 131072
    assert with_rope_scaling(base, {"type": "none"}).rope_freq_factors == ()


INVALID = [
    ({"type": "longrope", "factor": 2.0}, "'longrope' is not supported"),
    ({"rope_type": "su"}, "'su' is not supported"),
    ({"type": "linear", "factor": 0.5}, "factor must be >= 1"),
    ({"type": "dynamic"}, "'dynamic' needs rope_scaling.factor"),
    ({"type": "yarn", "factor": "4"}, "factor must be a number"),
    ({"type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "needs rope_scaling.low_freq_factor"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "needs rope_scaling.high_freq_factor"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "low_freq_factor <"),
    ({"type": "yarn", "factor": 4.0, "attention_factor": 0.0}, "attention_factor must be positive"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "must be positive"),
    ({"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize(("scaling", "message"), INVALID)
def test_invalid_scaling_is_a_model_load_error_naming_it(scaling: dict[str, Any], message: str) -> None:
    config = model_config(scaling)
    for call in (rope_parameters, scaled_context, lambda c: RotaryEmbedding(c, 8, torch.float32)):
        with pytest.raises(ModelLoadError, match=message):
            call(config)
    with pytest.raises(ModelLoadError, match=message):
        with_rope_scaling(model_config({}), scaling)


def test_override_with_an_unknown_key_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="unknown rope_scaling keys \\['fctor'\\]"):
        with_rope_scaling(model_config({}), {"type": "yarn", "fctor": 4.0})


HF_CONFIGS = {
    "transformers-5-yarn": {"max_position_embeddings": 32768, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": None, "mscale": 0.8, "mscale_all_dim": 1.0,
        "truncate": False}},
    "older-llama3": {"max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
    "type-and-attention-factor": {"max_position_embeddings": 4096, "rope_scaling": {
        "type": "yarn", "factor": 2.0, "attention_factor": 1.25}},
    "top-level-original": {"max_position_embeddings": 16384, "original_max_position_embeddings": 2048,
                           "rope_scaling": {"type": "yarn", "factor": 8.0}},
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_config_keeps_every_field_transformers_reads(tmp_path: Path, name: str) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
        "vocab_size": 16,
        **json.loads(json.dumps(HF_CONFIGS[name])),
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = rope_parameters(read_hf_config(tmp_path))
    inv, factor = reference(transformers.LlamaConfig.from_dict(raw))
    torch.testing.assert_close(ours.inv_freq, inv, **FP32)
    assert ours.attention_factor == factor


def write_gguf(path: Path, rope: dict[str, Any], freq_factors: tuple[float, ...] = ()) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(8)
    writer.add_head_count(4)
    writer.add_context_length(rope.pop("context_length"))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(16)
    writer.add_rope_freq_base(rope.pop("freq_base"))
    for key, value in rope.items():
        if key == "type":
            writer.add_string(f"llama.rope.scaling.{key}", value)
        elif key == "original_context_length":
            writer.add_uint32(f"llama.rope.scaling.{key}", value)
        else:
            writer.add_float32(f"llama.rope.scaling.{key}", value)
    if freq_factors:
        writer.add_tensor("rope_freqs.weight", np.array(freq_factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf_config(path: Path) -> ModelConfig:
    import gguf

    return read_config(gguf.GGUFReader(str(path)))


def test_gguf_yarn_metadata_keeps_every_field(tmp_path: Path) -> None:
    rope = {"context_length": 32768, "freq_base": 1e6, "type": "yarn", "factor": 4.0}
    rope |= {
        "original_context_length": 32768,
        "attn_factor": 0.75,
        "yarn_beta_fast": 16.0,
        "yarn_beta_slow": 2.0,
    }
    config = read_gguf_config(write_gguf(tmp_path / "m.gguf", rope))
    assert config.rope_scaling == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "attention_factor": 0.75,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    }
    inv, factor = reference(hf_config(config.rope_scaling, **{**QWEN, "head_dim": 64}))
    ours = rope_parameters(config)
    torch.testing.assert_close(ours.inv_freq, inv, **FP32)
    assert ours.attention_factor == factor == 0.75
    assert scaled_context(config) == 131072


def test_gguf_yarn_log_multiplier_cancels_the_attention_factor(tmp_path: Path) -> None:
    rope = {"context_length": 163840, "freq_base": 1e4, "type": "yarn", "factor": 40.0}
    rope |= {"original_context_length": 4096, "yarn_log_multiplier": 0.1}
    config = read_gguf_config(write_gguf(tmp_path / "m.gguf", rope))
    assert config.rope_scaling["mscale"] == config.rope_scaling["mscale_all_dim"] == pytest.approx(1.0)
    assert rope_parameters(config).attention_factor == pytest.approx(1.0)


def test_gguf_rope_freqs_tensor_is_llama3_scaling(tmp_path: Path) -> None:
    scaling = dict(CASES[-1][1])
    factors = llama_cpp_freq_factors(scaling, 64)
    rope = {"context_length": 131072, "freq_base": 500000.0}
    config = read_gguf_config(write_gguf(tmp_path / "m.gguf", rope, factors))
    assert config.rope_scaling == {} and config.rope_freq_factors == factors
    inv, _ = reference(hf_config(scaling, **{**LLAMA3, "head_dim": 64}))
    torch.testing.assert_close(rope_parameters(config).inv_freq, inv, rtol=1e-6, atol=0.0)
    assert scaled_context(config) == 131072
