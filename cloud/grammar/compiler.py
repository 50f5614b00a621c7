"""Compiling grammar specs for one tokenizer, with a bounded cache keyed by the spec.

Compilation never runs on the engine thread: AsyncEngine compiles on its grammar threads before it
queues a request, so a slow schema delays only requests that wait for a grammar, never a step.
Concurrent requests with the same spec wait for one compilation (single flight); a failed
compilation is not cached.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import xgrammar as xgr

from cloud.model.tokenizer import Tokenizer
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

from .compiled import CompiledGrammar
from .formats import grammar_schema
from .llg_engine import compile_llg, llg_tokenizer
from .productive import unproductive_rules
from .schema_paths import RefError
from .schema_support import check_schema
from .tool_grammar import tool_call_structural_tag

_WHAT = {"json_schema": "schema", "tool_calls": "schema", "regex": "regex", "ebnf": "grammar"}
_CODE = {"json_schema": "invalid_schema", "tool_calls": "invalid_schema", "regex": "invalid_regex"}


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar reads it. Control tokens are given as empty strings, which xgrammar
    treats as special: never allowed inside the grammar (a JSON string may not hold <|im_start|>), only
    as stop tokens at its end."""
    encoded = [
        "" if i in tokenizer.special_ids else (tokenizer.id_to_token(i) or "") for i in range(vocab_size)
    ]
    kind = xgr.VocabType.BYTE_LEVEL if tokenizer.byte_level else xgr.VocabType.RAW
    if tokenizer.byte_fallback:  # SentencePiece: "▁" is a space, "<0xE2>" one byte
        kind = xgr.VocabType.BYTE_FALLBACK
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_ids))


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 512) -> None:
        self.vocab_size = vocab_size
        # xgrammar's own cache is unbounded by default; ours is bounded and keyed by the whole spec
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size), max_threads=2, cache_enabled=False
        )
        self._llg_tokenizer = llg_tokenizer(tokenizer, vocab_size)
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The compiled grammar if it is ready now, else None (never waits)."""
        with self._lock:
            done = self._cache.get(spec.key)
        if done is None or not done.done() or done.exception() is not None:
            return None
        with self._lock:
            self._cache.move_to_end(spec.key)
            self.hits += 1
        return done.result()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`; raises InvalidRequestError if it cannot be compiled."""
        key = spec.key
        with self._lock:
            pending = self._cache.get(key)
            owner = pending is None
            if pending is None:
                pending = self._cache[key] = Future()
                self.misses += 1
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.hits += 1
        if owner:
            try:
                pending.set_result(self._compile(spec))
            except Exception as exc:
                with self._lock:
                    self._cache.pop(key, None)
                pending.set_exception(exc)
        return pending.result()

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                # the engine is chosen per schema by the same check the gateway ran on it
                source = json.loads(spec.source)
                if check_schema(source, spec.origin) == "llguidance":
                    return compile_llg(source, self._llg_tokenizer, spec.strict)
                schema = json.dumps(grammar_schema(source))
                return self._compiler.compile_json_schema(
                    schema, any_whitespace=False, strict_mode=spec.strict
                )
            if spec.kind == "tool_calls":
                _xgrammar_only(json.loads(spec.source)["functions"])
            if spec.kind in ("regex", "ebnf"):  # parsed once: checked, then compiled
                parsed = (
                    xgr.Grammar.from_regex(spec.source)
                    if spec.kind == "regex"
                    else xgr.Grammar.from_ebnf(spec.source)
                )
                _refuse_unfinishable(parsed, spec)
                return self._compiler.compile_grammar(parsed)
            return self._compiler.compile_structural_tag(tool_call_structural_tag(spec.source))
        except (RuntimeError, ValueError, RefError) as exc:
            raise InvalidRequestError(
                f"the {_WHAT[spec.kind]} cannot be compiled into a grammar: {_reason(exc)}",
                param=spec.origin,
                code=_CODE.get(spec.kind, "invalid_grammar"),
            ) from exc


def _refuse_unfinishable(grammar: xgr.Grammar, spec: GrammarSpec) -> None:
    """A grammar that derives no finite string is refused before decoding (productive.py): the model
    could only write until max_tokens, and the answer would never match."""
    stuck = unproductive_rules(str(grammar))
    if stuck and "root" in stuck:
        others = [name for name in stuck if name != "root"]
        also = f" (nor can {', '.join(others[:5])})" if others else ""
        raise InvalidRequestError(
            f"the {_WHAT[spec.kind]} matches no finite string: its root can never be completed{also}, "
            "so no output could ever match it",
            param=spec.origin,
            code=_CODE.get(spec.kind, "invalid_grammar"),
        )


def _xgrammar_only(functions: dict[str, Any]) -> None:
    """Tool calls compile through xgrammar's structural tags alone: parameters only llguidance can
    enforce are refused, not handed to a grammar that would drop their keywords."""
    for name, parameters in functions.items():
        if check_schema(parameters, "tools") == "llguidance":
            raise InvalidRequestError(
                f"the parameters of function {name!r} need llguidance, which tool calls cannot use: "
                "xgrammar cannot enforce them",
                param="tools",
                code="unsupported_schema_feature",
            )


# xgrammar prefixes its C++ messages with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_reason(exc: Exception) -> str:
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


def _reason(exc: Exception) -> str:
    if isinstance(exc, RefError):
        return f"$ref {exc.ref!r} {exc.detail}"
    return xgrammar_reason(exc)
