"""One entry point to load a model by path: a .gguf file or a Hugging Face directory, or by a
registered name (registry.py: `gemma-3-270m`, `smollm2-135m-instruct`; with no path, the default
model), fetched on first use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.errors import ModelLoadError

from .causal_lm import CausalLM
from .chat_template import ChatTemplate
from .linear import WeightPlan
from .registry import DEFAULT_MODEL, fetch, known_model
from .tokenizer import Tokenizer
from .weights import ModelWeights


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: ChatTemplate


def _resolve(path: str | Path | None) -> tuple[Path, str]:
    """The model's file or directory and its own name. A registered name is the registry's model
    unless a file or directory of that name exists (a path the user gave wins)."""
    if path is None:
        return fetch(), DEFAULT_MODEL.name
    p = Path(path).expanduser()
    source = known_model(str(path))
    if source is not None and not p.exists():
        return fetch(source), source.name
    return p, p.stem if p.is_file() else p.name


def load_model(path: str | Path | None = None) -> LoadedModel:
    p, name = _resolve(path)
    if p.is_dir():
        return _load_hf_dir(p, name)
    if not p.is_file():
        raise ModelLoadError(f"model not found: {p} (expected a .gguf file or a Hugging Face directory)")
    from .gguf_loader import open_gguf

    return load_gguf_model(open_gguf(p), p, name)


def load_gguf_model(reader: Any, path: Path, name: str) -> LoadedModel:
    """load_model over an open GGUF reader (a caller that reads the file's raw tensors too opens
    it once: parsing a 262K-token vocabulary takes seconds)."""
    from .gguf_loader import read_gguf

    weights, data = read_gguf(reader)
    tokenizer = Tokenizer.from_gguf_data(data)
    template = ChatTemplate(tokenizer.chat_template, *_bos_eos_text(tokenizer))
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


def _bos_eos_text(tok: Tokenizer) -> tuple[str, str]:
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else None
    return bos or "", eos or ""


def load_text_side(path: str | Path | None = None) -> tuple[Tokenizer, ChatTemplate]:
    """The model's tokenizer and chat template alone, no weights: what a gateway needs to name the
    prompt blocks a request will use (fleet routing)."""
    p, _ = _resolve(path)
    if p.is_dir():
        return _hf_text_side(p)
    if not p.is_file():
        raise ModelLoadError(f"model not found: {p} (expected a .gguf file or a Hugging Face directory)")
    from .gguf_loader import load_gguf_tokenizer

    tokenizer = Tokenizer.from_gguf_data(load_gguf_tokenizer(p))
    return tokenizer, ChatTemplate(tokenizer.chat_template, *_bos_eos_text(tokenizer))


def _load_hf_dir(d: Path, name: str) -> LoadedModel:
    from .hf_loader import load_hf_dir

    weights = load_hf_dir(d)
    tokenizer, template = _hf_text_side(d)
    return LoadedModel(name, d, weights, tokenizer, template)


def _hf_text_side(d: Path) -> tuple[Tokenizer, ChatTemplate]:
    cfg_path = d / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from exc

    def token_text(key: str) -> str | None:
        v = cfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    # transformers >= 4.47 writes the template to its own file; older versions into the config
    template_file = d / "chat_template.jinja"
    chat_template = template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
    probe = Tokenizer.from_hf_file(d / "tokenizer.json")
    bos, eos = token_text("bos_token"), token_text("eos_token")
    tokenizer = Tokenizer.from_hf_file(
        d / "tokenizer.json",
        bos_id=probe.token_to_id(bos) if bos else None,
        eos_id=probe.token_to_id(eos) if eos else None,
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=chat_template,
    )
    return tokenizer, ChatTemplate(chat_template, bos or "", eos or "")
