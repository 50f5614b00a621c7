"""Constrained decoding through the engine with a grammar llguidance compiled (a schema xgrammar
cannot enforce), in one batch beside an xgrammar-constrained request: each output follows its own
schema, and the engine never learns which engine built which grammar."""

from __future__ import annotations

import json

import jsonschema_rs

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.grammar.llg_engine import LlgGrammar
from shared.engine_types import SamplingParams
from shared.grammar_spec import GrammarSpec

CONFIG = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=1024)
# patternProperties and a pattern beside lengths: llguidance's
TAGS = {
    "type": "object",
    "patternProperties": {
        "^[a-z]{1,6}$": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5}
    },
    "additionalProperties": False,
    "maxProperties": 2,
}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


def test_llguidance_and_xgrammar_grammars_decode_side_by_side(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(CONFIG, loaded_model)
    prompt = core.encode_chat([{"role": "user", "content": "Give two short tags as JSON."}])
    for rid, schema in (("tags", TAGS), ("count", COUNT)):
        spec = GrammarSpec.json_schema(schema)
        core.add_request(rid, prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=3, grammar=spec))
    assert isinstance(core.compile_grammar(SamplingParams(grammar=GrammarSpec.json_schema(TAGS))), LlgGrammar)
    texts: dict[str, str] = {"tags": "", "count": ""}
    finish: dict[str, str | None] = {}
    while core.has_work():
        for out in core.step():
            texts[out.request_id] += out.text
            finish[out.request_id] = out.finish_reason
    for rid, schema in (("tags", TAGS), ("count", COUNT)):
        assert finish[rid] == "stop", (rid, texts[rid])
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(texts[rid])), (rid, texts[rid])
