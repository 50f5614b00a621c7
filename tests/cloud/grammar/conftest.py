"""The default model's tokenizer and a grammar compiler over it, shared by the grammar probes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.grammar.compiler import GrammarCompiler
from cloud.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size, cache_size=64)
