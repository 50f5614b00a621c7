"""What the engine needs of a model, whatever its family: the seam the runner, the CUDA graphs and
the memory profile are typed on (llama.py's LlamaModel and gemma3.py's Gemma3Model answer it)."""

from __future__ import annotations

from typing import Protocol

import torch

from .config import ModelConfig
from .llama import StepAttention
from .rope import RotaryEmbedding


class CausalLM(Protocol):
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    rope: RotaryEmbedding  # the global layers' tables (the sliding-window policy rotates sinks with it)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        logits_rows: torch.Tensor,
        max_position: int | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """One engine step: fp32 logits [rows, vocab], or final-normed hidden states when not head."""
        ...

    def resize_rope(self, max_positions: int) -> None: ...

    def attention_window(self, layer: int) -> int | None:
        """The layer's sliding window (the query's own position included), or None: every position."""
        ...
