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

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [tokens, 1, head_dim] each (looked up once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; q and k are rotated together in one call
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
