"""An instance fed token by token through a compiled grammar's matcher, whichever engine built it."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from cloud.grammar.compiled import CompiledGrammar
from cloud.grammar.llg_engine import LlgGrammar
from cloud.model.tokenizer import Tokenizer


def accepts(tok: Tokenizer, grammar: CompiledGrammar, instance: Any) -> bool:
    """Whether the grammar takes the instance as JSON (as a model writes it) and then its end."""
    tokens = [*tok.encode(json.dumps(instance, ensure_ascii=False)), min(tok.eos_ids)]
    if isinstance(grammar, LlgGrammar):
        matcher = grammar.matcher()
        return all(matcher.consume_token(t) for t in tokens) and matcher.is_stopped()
    xgr_matcher = xgr.GrammarMatcher(grammar)
    return all(xgr_matcher.accept_token(t) for t in tokens) and xgr_matcher.is_terminated()
