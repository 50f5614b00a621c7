"""The weight formats an engine can run, by name: what the CLI and the engine's configuration offer
without loading torch (the kernels behind each are in linear.py)."""

from __future__ import annotations

from typing import Literal

WeightQuant = Literal["auto", "none", "int8", "int4", "gguf"]
WEIGHT_QUANTS: tuple[WeightQuant, ...] = ("auto", "none", "int8", "int4", "gguf")
