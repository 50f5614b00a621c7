"""Rotary position embedding: frequencies as a pure function of the config, and the rotation.

Rotate-half convention (Hugging Face layout); loaders convert llama.cpp's interleaved layout.
The long-context issue adds the scaled variants (linear, dynamic NTK, YaRN, llama3) here.
"""

from __future__ import annotations

import torch

from shared.errors import ModelLoadError

from .config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, fp32."""
    stype = config.rope_scaling.get("type", "none") if config.rope_scaling else "none"
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if stype in ("none", "default"):
        return inv
    if stype == "linear":
        return inv / float(config.rope_scaling.get("factor", 1.0))
    raise ModelLoadError(f"RoPE scaling {stype!r} is not supported yet")


class RotaryEmbedding:
    """Precomputed cos / sin tables indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        inv = inv_frequencies(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.max_positions = max_positions

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], positions: [tokens]
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
