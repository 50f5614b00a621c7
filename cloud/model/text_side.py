"""Which model a path or name means, and its text side alone: the tokenizer and chat template, read
without the weights or torch (what a gateway in front of the engine, or a router with none, needs)."""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ModelLoadError
from shared.fleet_protocol import TextSide

from .chat_template import ChatTemplate
from .registry import DEFAULT_MODEL, fetch, known_model
from .tokenizer import Tokenizer


def resolve_model(path: str | Path | None) -> tuple[Path, str]:
    """The model's file or directory and its own name. A registered name is the registry's model
    unless a file or directory of that name exists (a path the user gave wins)."""
    if path is None:
        return fetch(), DEFAULT_MODEL.name
    p = Path(path).expanduser()
    source = known_model(str(path))
    if source is not None and not p.exists():
        return fetch(source), source.name
    return p, p.stem if p.is_file() else p.name


def bos_eos_text(tok: Tokenizer) -> tuple[str, str]:
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else None
    return bos or "", eos or ""


def load_text_side(path: str | Path | None = None) -> tuple[Tokenizer, ChatTemplate]:
    """The model's tokenizer and chat template alone, no weights: what a gateway needs to name the
    prompt blocks a request will use (fleet routing)."""
    p, _ = resolve_model(path)
    if p.is_dir():
        return hf_text_side(p)
    if not p.is_file():
        raise ModelLoadError(f"model not found: {p} (expected a .gguf file or a Hugging Face directory)")
    from .gguf_vocab import load_gguf_tokenizer

    tokenizer = Tokenizer.from_gguf_data(load_gguf_tokenizer(p))
    return tokenizer, ChatTemplate(tokenizer.chat_template, *bos_eos_text(tokenizer))


def hf_text_side(d: Path) -> tuple[Tokenizer, ChatTemplate]:
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


def describe_text_side(
    model: str,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    *,
    max_model_len: int = 0,
    hidden_size: int = 0,
    context_overflow: str = "error",
) -> TextSide:
    """What a worker sends its router (GET /internal/v1/text-side)."""
    return TextSide(
        model=model,
        max_model_len=max_model_len,
        hidden_size=hidden_size,
        context_overflow=context_overflow,
        tokenizer_json=tokenizer.backend_json(),
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        add_bos=tokenizer.add_bos,
        add_eos=tokenizer.add_eos,
        template=template.source,
        bos_token=template.bos_token,
        eos_token=template.eos_token,
    )


def text_side_from(side: TextSide) -> tuple[Tokenizer, ChatTemplate]:
    """The tokenizer and template a worker described; raises ModelLoadError if they do not load."""
    try:
        tokenizer = Tokenizer.from_backend_json(
            side.tokenizer_json,
            bos_id=side.bos_id,
            eos_id=side.eos_id,
            add_bos=side.add_bos,
            add_eos=side.add_eos,
            chat_template=side.template,
        )
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ModelLoadError(f"the tokenizer of {side.model!r} does not load: {exc}") from exc
    template = ChatTemplate(
        side.template, side.bos_token, side.eos_token, f"the chat template of {side.model!r}"
    )
    return tokenizer, template
