"""What a grammar compiles to, whichever engine compiled it: the engine's masks (grammar_mask.py)
build a matcher from either kind, so nothing else needs to know which engine a schema chose."""

from __future__ import annotations

from typing import TypeAlias

import xgrammar as xgr

from .llg_engine import LlgGrammar

CompiledGrammar: TypeAlias = xgr.CompiledGrammar | LlgGrammar
