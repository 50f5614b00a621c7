"""llguidance, the second grammar engine: JSON schemas xgrammar cannot enforce but llguidance can
(patternProperties, a pattern beside lengths or a format, keywords beside an enum, a $ref or a
composition, multipleOf on decimals), as schema_support.check_schema chooses per schema.

llguidance is run in its refusing mode: `lenient` off, so a keyword it does not implement is an
error rather than dropped, and `coerce_one_of` off, so a oneOf whose branches it cannot show
disjoint is an error rather than read as anyOf. The keywords it is trusted with are proven by the
probes in tests/cloud/grammar/test_llg_support.py, through its matcher and the default model's
tokenizer. JSON is written as xgrammar writes it (json.dumps's separators, no free whitespace).

The strict reading (xgrammar's strict_mode, our default) is given to llguidance as a rewrite: every
object that does not say what its unlisted properties may be gets `additionalProperties: false`.
That only narrows what is accepted, so it stays sound, except under `oneOf` (llguidance would prove
the *closed* branches exclusive, and an instance of one could still match another branch as
written), `not` (narrowing a negated schema widens the whole) and `allOf` (closing each branch can
leave nothing to generate): a schema with any of these keeps the reading as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from cloud.model.tokenizer import Tokenizer

from .formats import llg_schema

_OPTIONS: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "coerce_one_of": False,
    "lenient": False,
}


@dataclass(frozen=True, slots=True)
class LlgGrammar:
    """A grammar llguidance compiled for one tokenizer; a matcher is built from it per request."""

    tokenizer: llg.LLTokenizer
    grammar: str  # llguidance's own grammar text (JSON), as grammar_from_json_schema writes it

    def matcher(self) -> llg.LLMatcher:
        return llg.LLMatcher(self.tokenizer, self.grammar, log_level=0)


def llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    """The vocabulary as llguidance reads it, built from the same tokenizer JSON our Rust backend
    holds; `vocab_size` pads it to the model's logits width, as xgrammar's TokenizerInfo is."""
    # the backend's JSON is what Tokenizer pickles as too: llguidance reads the same vocabulary,
    # merges and pre-tokenizer, byte-level or SentencePiece
    backend_json = tokenizer._backend.to_str()
    return llg.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_ids))


_OPEN_WORLD = ("oneOf", "not", "allOf")  # keywords under which closing objects would be unsound
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames")


def _mentions(node: object, keywords: tuple[str, ...]) -> bool:
    if isinstance(node, dict):
        return any(k in node for k in keywords) or any(_mentions(v, keywords) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, keywords) for v in node)
    return False


def _close(node: Any) -> Any:
    """`node` with every object schema closed to the properties it lists (see the docstring)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    for key in ("anyOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    return out


def llg_grammar_text(schema: dict[str, Any], strict: bool = False) -> str:
    """The llguidance grammar for a checked schema, read as the checker read it (normalized), with our
    exact date patterns for its formats (llg_schema); `strict`: objects closed where that is sound."""
    ours = llg_schema(schema)
    if strict and not _mentions(ours, _OPEN_WORLD):
        ours = _close(ours)
    text = json.dumps(ours)
    return llg.LLMatcher.grammar_from_json_schema(text, overrides=_OPTIONS)  # type: ignore[arg-type]


def llg_refusal(grammar: str, tokenizer: llg.LLTokenizer | None = None) -> str | None:
    """Why llguidance cannot build `grammar` exactly (an unimplemented keyword, a oneOf it cannot
    show exclusive, ...), or None. Without a tokenizer only the grammar itself is checked."""
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if not error or error.startswith("WARNING"):
        return None
    # its hint to turn on coerce_one_of is no advice for a client: that reading would fail open
    return error.strip().splitlines()[0].split(". Enable 'coerce_one_of'")[0]


def compile_llg(schema: dict[str, Any], tokenizer: llg.LLTokenizer, strict: bool = False) -> LlgGrammar:
    """Raises ValueError with llguidance's reason when it cannot compile the schema exactly; `strict`:
    the strict reading, where sound."""
    text = llg_grammar_text(schema, strict)
    reason = llg_refusal(text, tokenizer)
    if reason is not None:
        raise ValueError(reason)
    return LlgGrammar(tokenizer, text)
