"""Rotary position embedding: frequencies as a pure function of the config, and the rotation.

Rotate-half convention (Hugging Face layout); loaders convert llama.cpp's interleaved layout.
The scaled variants follow transformers' `rope_parameters` and match its numbers (test_rope.py):
  linear   every frequency / factor (positions squeezed into the trained range)
  dynamic  NTK-aware: theta grows with the sequence length. Our tables are built once, so the length
           is the engine's max model length (vLLM's choice), not the running length transformers uses
  yarn     per frequency, a blend of interpolation and extrapolation, plus an attention factor on cos/sin
  llama3   low frequencies / factor, high ones kept, a smooth band between
The engine's default max_model_len is `scaled_context(config)`; a user's `--rope-scaling` goes through
`with_rope_scaling`. Every invalid setting is a ModelLoadError naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shared.errors import ModelLoadError

from .config import ModelConfig

SCALING_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# what a user override may name: every key transformers reads for the types above
_KNOWN_KEYS = frozenset(
    {"type", "rope_type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast"}
    | {"beta_slow", "mscale", "mscale_all_dim", "truncate", "low_freq_factor", "high_freq_factor"}
    | {"partial_rotary_factor"}
)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A validated `rope_scaling` dict; the fields a type does not read keep their defaults."""

    kind: str  # one of SCALING_TYPES
    original: int  # the context before scaling: original_max_position_embeddings, else max_position
    factor: float = 1.0  # >= 1
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale / mscale_all_dim)
    beta_fast: float = 32.0  # yarn: frequencies turning more than this often in `original` extrapolate
    beta_slow: float = 1.0  # yarn: ... and fewer than this interpolate
    mscale: float = 0.0  # yarn, DeepSeek style: both set -> attention factor is their ratio
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    low_freq_factor: float = 1.0  # llama3: wavelengths over original / low_freq_factor are interpolated
    high_freq_factor: float = 4.0  # llama3: wavelengths under original / high_freq_factor are kept


@dataclass(frozen=True, slots=True)
class RopeParams:
    inv_freq: torch.Tensor  # [head_dim // 2] fp32, radians per position
    attention_factor: float  # multiplies cos and sin (YaRN's mscale); 1.0 for the other types


def _number(scaling: Mapping[str, object], key: str, default: float | None) -> float:
    value = scaling.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"RoPE scaling {_kind(scaling)!r} needs rope_scaling.{key}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"rope_scaling.{key} must be a number, got {value!r}")
    return float(value)


def _kind(scaling: Mapping[str, object]) -> str:
    # transformers reads rope_type first and falls back on the older "type"
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    return "default" if kind == "none" else kind


def parse_rope_scaling(config: ModelConfig) -> RopeScaling:
    """Validate `config.rope_scaling` (ModelLoadError naming the bad key) into a typed value."""
    s = config.rope_scaling
    kind = _kind(s)
    if kind not in SCALING_TYPES:
        raise ModelLoadError(
            f"RoPE scaling type {kind!r} is not supported; supported: {', '.join(SCALING_TYPES)}"
        )
    if (partial := _number(s, "partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    original = int(_number(s, "original_max_position_embeddings", config.max_position))
    if original <= 0:
        raise ModelLoadError(
            f"rope_scaling.original_max_position_embeddings must be positive, got {original}"
        )
    if kind == "default":
        return RopeScaling(kind, original)
    # transformers' DeepSeek rule: a YaRN config without a factor scales original up to max_position
    implied = config.max_position / original if kind == "yarn" else None
    factor = _number(s, "factor", implied)
    if factor < 1.0:
        raise ModelLoadError(f"rope_scaling.factor must be >= 1, got {factor}")
    if kind == "yarn":
        return _yarn_scaling(s, original, factor)
    if kind == "llama3":
        low, high = _number(s, "low_freq_factor", None), _number(s, "high_freq_factor", None)
        if not 0 < low < high:
            raise ModelLoadError(
                f"llama3 RoPE needs 0 < low_freq_factor < high_freq_factor, got {low}, {high}"
            )
        return RopeScaling(kind, original, factor, low_freq_factor=low, high_freq_factor=high)
    return RopeScaling(kind, original, factor)


def _yarn_scaling(s: Mapping[str, object], original: int, factor: float) -> RopeScaling:
    attention = None if s.get("attention_factor") is None else _number(s, "attention_factor", None)
    if attention is not None and attention <= 0:
        raise ModelLoadError(f"rope_scaling.attention_factor must be positive, got {attention}")
    return RopeScaling(
        "yarn",
        original,
        factor,
        attention_factor=attention,
        # transformers treats 0 like absent for these four
        beta_fast=_number(s, "beta_fast", 0.0) or 32.0,
        beta_slow=_number(s, "beta_slow", 0.0) or 1.0,
        mscale=_number(s, "mscale", 0.0),
        mscale_all_dim=_number(s, "mscale_all_dim", 0.0),
        truncate=bool(s.get("truncate", True)),
    )


def rope_parameters(config: ModelConfig, seq_len: int | None = None) -> RopeParams:
    """Frequencies and attention factor. seq_len: dynamic NTK only, the longest sequence served
    (never below the original context; None: the original context)."""
    s = parse_rope_scaling(config)
    dim, theta = config.head_dim, config.rope_theta
    if s.kind == "dynamic":
        length = max(seq_len or s.original, s.original)
        theta = theta * ((s.factor * length / s.original) - (s.factor - 1)) ** (dim / (dim - 2))
    # [dim // 2] positions per radian of each rotated pair: theta^(2i / dim)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / pos_freqs
    attention = 1.0
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "yarn":
        inv = _yarn_inv_freq(pos_freqs, s, theta, dim)
        attention = _yarn_attention_factor(s)
    elif s.kind == "llama3":
        inv = _llama3_inv_freq(inv, s)
    if config.rope_freq_factors:
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return RopeParams(inv, attention)


def _yarn_inv_freq(pos_freqs: torch.Tensor, s: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    def dim_turning(turns: float) -> float:
        # the (fractional) pair index whose frequency turns `turns` times over the original context
        return dim * math.log(s.original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    # [dim // 2] 0: fast pairs, kept as trained (extrapolation); 1: slow pairs, interpolated by factor
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / pos_freqs * (1 - ramp) + 1.0 / (s.factor * pos_freqs) * ramp


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, weight: float) -> float:
        # the paper's sqrt(1/t) = 0.1 ln(s) + 1; on both q and k it divides the logits by t, countering
        # the flatter softmax that a longer context brings
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor, 1.0)


def _llama3_inv_freq(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv  # [dim // 2] positions per turn
    # 0 at wavelength original / low_freq_factor (fully interpolated), 1 at original / high_freq_factor (kept)
    smooth = (s.original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > s.original / s.low_freq_factor, inv / s.factor, blended)
    return torch.where(wavelen < s.original / s.high_freq_factor, inv, out)


def scaled_context(config: ModelConfig) -> int:
    """The context the model serves with its scaling: the engine's default max_model_len."""
    s = parse_rope_scaling(config)
    if s.kind == "default":
        return config.max_position
    if s.kind == "llama3" and config.max_position > s.original:
        return config.max_position  # Llama 3.1 states its scaled context (131072) itself
    return max(config.max_position, int(s.original * s.factor))


def with_rope_scaling(config: ModelConfig, scaling: Mapping[str, float | str]) -> ModelConfig:
    """A copy of config with the user's scaling in place of the model's (validated: ModelLoadError).

    The GGUF frequency factors go too: they are the model's own llama3 scaling, which this replaces."""
    unknown = sorted(set(scaling) - _KNOWN_KEYS)
    if unknown:
        raise ModelLoadError(f"unknown rope_scaling keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
    scaled = dataclasses.replace(config, rope_scaling=dict(scaling), rope_freq_factors=())
    parse_rope_scaling(scaled)
    return scaled


class RotaryEmbedding:
    """Precomputed cos / sin tables indexed by absolute position, attention factor included.

    Dynamic NTK is evaluated once, at seq_len = max_positions."""

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        params = rope_parameters(config, seq_len=max_positions)
        # float64 angles: in fp32, position * inv_freq loses the phase at long positions
        t = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(t, params.inv_freq.double())  # [positions, head_dim // 2] radians
        cos, sin = angles.cos() * params.attention_factor, angles.sin() * params.attention_factor
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)  # [positions, head_dim]
        self.sin = torch.cat([sin, sin], dim=-1).to(device=device, dtype=dtype)
        self.max_positions = max_positions
        self.attention_factor = params.attention_factor
        self.inv_freq = params.inv_freq.double().to(device)
        self.dtype = dtype

    def tables(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [tokens, 1, head_dim] each (looked up once per step).
        Positions past the tables (a sliding-window request runs on without end) are computed.
        max_position: the largest of `positions` when the caller knows it (no device sync)."""
        if max_position is None and positions.numel():
            max_position = int(positions.max())
        if max_position is not None and max_position >= self.max_positions:
            cos, sin = self._cos_sin(positions.double(), self.attention_factor)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _cos_sin(self, positions: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.unsqueeze(-1) * self.inv_freq  # [..., head_dim // 2], float64
        cos, sin = angles.cos() * factor, angles.sin() * factor
        return torch.cat([cos, cos], dim=-1).to(self.dtype), torch.cat([sin, sin], dim=-1).to(self.dtype)

    def shift(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate already-rotated vectors on by `delta` positions (a pure rotation: R(a) R(b) = R(a + b)).
        x: [..., n, head_dim]; delta: [...] (one shift per leading index, broadcast over n)."""
        cos, sin = self._cos_sin(delta.double(), 1.0)  # [..., head_dim]
        return self.apply(x, cos.unsqueeze(-2), sin.unsqueeze(-2))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; q and k are rotated together in one call
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
