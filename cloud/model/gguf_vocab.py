"""A GGUF file's tokenizer and chat template, read without its tensors: what the tokenizer needs, for
a process that holds no weights (the fleet router) as much as for the engine (gguf_loader.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GGUFTokenizerData:
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE: scores, byte fallback)
    pre: str  # pre-tokenizer name, e.g. "smollm", "qwen2", "llama-bpe"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    scores: list[float] = field(default_factory=list)  # SentencePiece piece scores ("llama" only)
    add_eos: bool = False
    add_space_prefix: bool = False  # SentencePiece's dummy "▁" before the text
    arch: str = ""  # general.architecture: picks a chat template for a file that carries none


def open_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError ... on damage
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_tokenizer_data(reader: Any) -> GGUFTokenizerData:
    model = _field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama') are supported"
        )
    return GGUFTokenizerData(
        model=model,
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type", [])],
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        scores=[float(x) for x in _field(reader, "tokenizer.ggml.scores", [])],
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", model == "llama")),
        arch=str(_field(reader, "general.architecture", "")),
    )


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizerData:
    """Read only the tokenizer metadata of a GGUF file (no tensor is dequantized)."""
    return read_tokenizer_data(open_gguf(Path(path)))
