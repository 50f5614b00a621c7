"""One entry point to load a model by path: a .gguf file or a Hugging Face directory, or by a
registered name (registry.py: `gemma-3-270m`, `smollm2-135m-instruct`; with no path, the default
model), fetched on first use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.errors import ModelLoadError

from .causal_lm import CausalLM
from .chat_template import ChatTemplate
from .linear import WeightPlan
from .text_side import bos_eos_text, hf_text_side, resolve_model
from .tokenizer import Tokenizer
from .weights import ModelWeights


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: ChatTemplate


def load_model(path: str | Path | None = None) -> LoadedModel:
    p, name = resolve_model(path)
    if p.is_dir():
        return _load_hf_dir(p, name)
    if not p.is_file():
        raise ModelLoadError(f"model not found: {p} (expected a .gguf file or a Hugging Face directory)")
    from cloud.model.gguf_vocab import open_gguf

    return load_gguf_model(open_gguf(p), p, name)


def load_gguf_model(reader: Any, path: Path, name: str) -> LoadedModel:
    """load_model over an open GGUF reader (a caller that reads the file's raw tensors too opens
    it once: parsing a 262K-token vocabulary takes seconds)."""
    from .gguf_loader import read_gguf

    weights, data = read_gguf(reader)
    tokenizer = Tokenizer.from_gguf_data(data)
    template = ChatTemplate(tokenizer.chat_template, *bos_eos_text(tokenizer))
    return LoadedModel(name, path, weights, tokenizer, template)


def build_model(
    weights: ModelWeights,
    *,
    dtype: torch.dtype = torch.float32,
    plan: WeightPlan | None = None,
    max_positions: int | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """The forward for the weights' architecture: Gemma 3's, or the Llama family's."""
    if weights.config.arch == "gemma3":
        from .gemma3 import Gemma3Model

        return Gemma3Model(weights, dtype=dtype, plan=plan, max_positions=max_positions, device=device)
    from .llama import LlamaModel

    return LlamaModel(weights, dtype=dtype, plan=plan, max_positions=max_positions, device=device)


def _load_hf_dir(d: Path, name: str) -> LoadedModel:
    from .hf_loader import load_hf_dir

    weights = load_hf_dir(d)
    tokenizer, template = hf_text_side(d)
    return LoadedModel(name, d, weights, tokenizer, template)
