"""What the long-context benchmark's tests share: the engine's chat encoding without the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.bench.longctx_data import Encoder
from cloud.model.chat_template import ChatTemplate
from cloud.model.gguf_vocab import load_gguf_tokenizer
from cloud.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def enc(gguf_path: Path) -> Encoder:
    """The default model's tokenizer and chat template, encoding a chat as EngineCore.encode_chat does."""
    data = load_gguf_tokenizer(gguf_path)
    tok = Tokenizer.from_gguf_data(data)

    def name(i: int | None) -> str:
        return data.tokens[i] if i is not None else ""

    template = ChatTemplate(data.chat_template, name(data.bos_id), name(data.eos_id))
    return Encoder(
        lambda m: tok.encode(template.render(m, add_generation_prompt=True), add_special=False), tok
    )
