"""Constrained decoding in the engine: every constrained request follows its own grammar inside one
batch, the masked choice is the reference model's best allowed token, compiled grammars are cached,
and a slow compilation never holds up the engine."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema_rs
import pytest
import torch
import xgrammar as xgr

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from shared.engine_types import RequestOutput, SamplingParams
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

CONFIG = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=1024)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
    "required": ["ok", "note"],
}


@pytest.fixture()
def core(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(CONFIG, loaded_model)


def ids_for(core: EngineCore, text: str) -> list[int]:
    return core.encode_chat([{"role": "user", "content": text}])


def run(
    core: EngineCore, first: list[RequestOutput] | None = None
) -> dict[str, tuple[list[int], str, str | None]]:
    """Step until idle (after `first`, the outputs of steps already taken); request id -> (tokens,
    text, finish reason)."""
    out: dict[str, tuple[list[int], str, str | None]] = {}
    pending = list(first or [])
    while pending or core.has_work():
        for o in pending or core.step():
            tokens, text, _ = out.get(o.request_id, ([], "", None))
            out[o.request_id] = (tokens + o.token_ids, text + o.text, o.finish_reason)
        pending = []
    return out


def valid(schema: dict, text: str) -> bool:  # type: ignore[type-arg]
    return jsonschema_rs.validator_for(schema).is_valid(json.loads(text))


def test_requests_with_different_schemas_in_one_batch_each_follow_their_own(core: EngineCore) -> None:
    prompt = ids_for(core, "Describe a person, some colours and a flag as JSON.")
    schemas = {"person": PERSON, "colours": COLOURS, "flag": FLAG}
    for rid, schema in schemas.items():
        core.add_request(
            rid, prompt, SamplingParams(max_tokens=60, temperature=0, grammar=GrammarSpec.json_schema(schema))
        )
    core.add_request("free", prompt, SamplingParams(max_tokens=8, temperature=0))
    first = core.step()  # one prefill step admits all four: they decode as one batch from here
    assert len(core.scheduler.running) == 4
    out = run(core, first)
    for rid, schema in schemas.items():
        _, text, finish = out[rid]
        assert finish == "stop", (rid, text)
        assert valid(schema, text), (rid, text)
    assert out["free"][2] in ("stop", "length")


def test_sampled_constrained_outputs_are_valid_for_many_seeds(core: EngineCore) -> None:
    prompt = ids_for(core, "Give me a person as JSON.")
    for seed in range(6):
        params = SamplingParams(
            max_tokens=60, temperature=1.0, seed=seed, grammar=GrammarSpec.json_schema(PERSON)
        )
        core.add_request(f"s{seed}", prompt, params)
    for rid, (_, text, finish) in run(core).items():
        if finish == "stop":  # a sample may ramble until max_tokens; a finished one must be valid
            assert valid(PERSON, text), (rid, text)
        else:
            assert finish == "length"


@pytest.mark.slow
def test_constrained_greedy_choice_is_the_reference_models_best_allowed_token(
    core: EngineCore,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    prompt = ids_for(core, "Describe a fictional person as JSON.")
    core.add_request(
        "p", prompt, SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec.json_schema(PERSON))
    )
    tokens, _, _ = run(core)["p"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
    matcher = xgr.GrammarMatcher(core.grammars.compile(GrammarSpec.json_schema(PERSON)))
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    for i, token in enumerate(tokens):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[i : i + 1].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        best = int(row.argmax())
        # our engine and transformers differ in float rounding: a different pick must be a near tie
        assert token == best or float(row[0, best] - row[0, token]) < 1e-3, (i, token, best)
        assert matcher.accept_token(token)
    assert matcher.is_terminated()  # the last token was the end-of-turn the completed grammar allows


def test_max_tokens_cuts_constrained_output_with_finish_length(core: EngineCore) -> None:
    prompt = ids_for(core, "Give me a person as JSON.")
    core.add_request(
        "cut", prompt, SamplingParams(max_tokens=4, temperature=0, grammar=GrammarSpec.json_schema(PERSON))
    )
    tokens, text, finish = run(core)["cut"]
    assert finish == "length" and len(tokens) == 4
    with pytest.raises(ValueError):
        json.loads(text)


def test_ignore_eos_with_a_grammar_is_refused_before_queueing(core: EngineCore) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True, grammar=GrammarSpec.json_schema(PERSON))
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("x", ids_for(core, "hi"), params)
    assert err.value.param == "ignore_eos"
    assert not core.has_work()


def test_compiled_grammars_are_cached_by_spec(core: EngineCore) -> None:
    grammars = core.grammars
    first = grammars.compile(GrammarSpec.json_schema(PERSON))
    misses = grammars.misses
    assert grammars.compile(GrammarSpec.json_schema(json.loads(json.dumps(PERSON)))) is first
    assert grammars.cached(GrammarSpec.json_schema(PERSON)) is first
    assert grammars.misses == misses
    reordered = {"type": "object", "required": ["name", "age"], "properties": PERSON["properties"]}
    assert grammars.cached(GrammarSpec.json_schema(reordered)) is None  # key order is part of the key


def test_a_schema_that_cannot_compile_is_the_clients_error(core: EngineCore) -> None:
    with pytest.raises(InvalidRequestError) as err:
        core.grammars.compile(GrammarSpec.json_schema({"$ref": "#/$defs/missing"}, origin="response_format"))
    assert err.value.code == "invalid_schema" and "$defs" in err.value.message


HANG_GUARD_S = 120.0  # liveness only: how long a held step may wait before the test calls it hung


def test_a_slow_compilation_does_not_hold_up_other_requests(
    loaded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grammar's compilation is held at a gate that only the plain request's end opens, so it is
    "slow" for exactly as long as the plain request takes: if compiling blocked the event loop, the
    engine or other submissions, the plain request could never finish and the gate would time out."""
    engine = AsyncEngine(EngineCore(CONFIG, loaded_model))
    core = engine.core
    compiling = threading.Event()  # the constrained request's compilation has begun
    release = threading.Event()  # lets that compilation go on
    order: list[str] = []
    real_compile = core.grammars.compile

    def held_compile(spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiling.set()
        assert release.wait(HANG_GUARD_S), "the plain request never finished while a grammar compiled"
        order.append("compilation released")
        return real_compile(spec)

    monkeypatch.setattr(core.grammars, "compile", held_compile)

    async def constrained() -> None:
        params = SamplingParams(max_tokens=4, temperature=0, grammar=GrammarSpec.json_schema(PERSON))
        async for _ in await engine.open(ids_for(core, "JSON please."), params):
            pass
        order.append("constrained finished")

    async def plain() -> None:
        assert await asyncio.to_thread(compiling.wait, HANG_GUARD_S), "the compilation never began"
        async for _ in engine.generate(ids_for(core, "Say hi."), SamplingParams(max_tokens=3, temperature=0)):
            pass
        order.append("plain finished")
        release.set()

    async def both() -> None:
        await asyncio.gather(constrained(), plain())

    try:
        asyncio.run(both())
    finally:
        release.set()
        engine.shutdown()
    assert order == ["plain finished", "compilation released", "constrained finished"]


def test_a_grammar_dead_end_ends_that_choice_with_a_readable_error_and_the_others_go_on(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matcher that allows no token (injected: a real vocabulary can spell every byte) ends its
    choice with finish "error" and the client's code, not an engine failure; an unconstrained request
    in the same batch finishes normally."""
    prompt = ids_for(core, "Describe a person as JSON.")
    core.add_request(
        "stuck", prompt, SamplingParams(max_tokens=20, temperature=0, grammar=GrammarSpec.json_schema(PERSON))
    )
    core.add_request("free", prompt, SamplingParams(max_tokens=4, temperature=0))
    masks = core.runner.sampler.grammars
    accept = masks.accept
    monkeypatch.setattr(
        masks, "accept", lambda row, token: False if row.request_id == "stuck" else accept(row, token)
    )
    finals: dict[str, RequestOutput] = {}
    while core.has_work():
        for o in core.step():
            if o.finished:
                finals[o.request_id] = o
    stuck, free = finals["stuck"], finals["free"]
    assert (stuck.finish_reason, stuck.error_code) == ("error", "grammar_dead_end")
    assert stuck.error is not None and "dead end" in stuck.error and "engine error" not in stuck.error
    assert (free.finish_reason, free.error_code, free.num_output_tokens) == ("length", None, 4)
