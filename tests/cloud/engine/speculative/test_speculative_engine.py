"""Speculative decoding by prompt lookup in the engine: the same tokens as decoding one at a time
(greedy, seeded sampling with penalties, a grammar, int8 KV), in fewer steps; stop strings and
max_tokens land where they would; blocks computed under drafts serve later prefix hits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from shared.engine_types import RequestOutput, SamplingParams
from shared.grammar_spec import GrammarSpec

CONFIG = EngineConfig(weight_quant="gguf", kv_cache_memory_gib=0.25, max_model_len=2048)
COLOURS = ("red", "blue", "green", "amber")
DOC = "\n".join(
    f"Item {i}: the {COLOURS[i % 4]} box number {i} holds {i * 7} marbles and weighs {i + 3} kilograms."
    for i in range(16)
)


def ask(core: EngineCore, question: str) -> list[int]:
    return core.encode_chat([{"role": "user", "content": f"{DOC}\n\n{question}"}])


def run(core: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[RequestOutput], int]:
    """The request's outputs, and the steps it took."""
    core.add_request("r", prompt, params)
    outs, steps = [], 0
    while core.has_work():
        outs += core.step()
        steps += 1
    return outs, steps


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.fixture(scope="module")
def off(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(CONFIG, loaded_model)


@pytest.fixture(scope="module")
def ngram(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(replace(CONFIG, speculative="ngram"), loaded_model)


def test_a_copied_span_is_the_same_greedy_text_in_fewer_steps(off: EngineCore, ngram: EngineCore) -> None:
    prompt = ask(off, "Copy items 5 to 7 exactly as written.")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    (plain, plain_steps), (spec, spec_steps) = run(off, prompt, params), run(ngram, prompt, params)
    assert tokens(spec) == tokens(plain) and "".join(o.text for o in spec) == "".join(o.text for o in plain)
    assert spec[-1].num_output_tokens == plain[-1].num_output_tokens == len(tokens(plain))
    last = spec[-1]
    assert 0 < last.num_accepted_tokens <= last.num_draft_tokens
    assert spec_steps < 0.7 * plain_steps  # the copy is drafted well
    stats = ngram.stats()
    assert stats.spec_accepted_tokens >= last.num_accepted_tokens > 0
    assert plain[-1].num_draft_tokens == 0


def test_seeded_sampling_with_penalties_and_logprobs_draws_the_same_tokens(
    off: EngineCore, ngram: EngineCore
) -> None:
    """Sampling noise is a function of (seed, step, token): position p of a verified chunk draws what
    step p would have drawn, so a seeded request's tokens do not change."""
    prompt = ask(off, "Copy item 9 exactly as written.")
    params = SamplingParams(
        max_tokens=32, temperature=0.7, top_p=0.95, seed=11, frequency_penalty=0.2, logprobs=2
    )
    plain, _ = run(off, prompt, params)
    spec, _ = run(ngram, prompt, params)
    assert tokens(spec) == tokens(plain) and spec[-1].num_accepted_tokens > 0
    lp_plain = [s.logprob for o in plain for s in o.logprobs]
    lp_spec = [s.logprob for o in spec for s in o.logprobs]
    assert len(lp_spec) == len(tokens(spec))
    assert lp_spec == pytest.approx(lp_plain, abs=2e-3)


def test_a_grammar_advances_over_accepted_tokens_only(off: EngineCore, ngram: EngineCore) -> None:
    schema = {
        "type": "object",
        "properties": {"item": {"type": "integer"}, "text": {"type": "string"}},
        "required": ["item", "text"],
    }
    prompt = ask(off, 'Answer in JSON with keys "item" and "text": quote item 4 exactly.')
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=GrammarSpec.json_schema(schema))
    plain, _ = run(off, prompt, params)
    spec, _ = run(ngram, prompt, params)
    assert tokens(spec) == tokens(plain) and spec[-1].num_accepted_tokens > 0
    if spec[-1].finish_reason == "stop":
        assert set(json.loads("".join(o.text for o in spec))) == {"item", "text"}


def test_stop_strings_and_max_tokens_land_inside_drafts_as_without(
    off: EngineCore, ngram: EngineCore
) -> None:
    prompt = ask(off, "Copy items 2 to 6 exactly as written.")
    for params in (
        SamplingParams(max_tokens=60, temperature=0.0, stop=["marbles and"]),
        SamplingParams(max_tokens=23, temperature=0.0),
    ):
        plain, _ = run(off, prompt, params)
        spec, _ = run(ngram, prompt, params)
        assert "".join(o.text for o in spec) == "".join(o.text for o in plain)
        assert spec[-1].finish_reason == plain[-1].finish_reason
        assert spec[-1].num_output_tokens == plain[-1].num_output_tokens
    assert plain[-1].num_output_tokens == 23 and plain[-1].finish_reason == "length"


def test_blocks_computed_under_drafts_serve_a_continuation_from_the_prefix_cache(
    ngram: EngineCore,
    loaded_model,  # type: ignore[no-untyped-def]
) -> None:
    """A follow-up turn takes the first answer's blocks from the cache: had a rejected draft's KV
    been kept (or its block cached), the follow-up would differ from one computed afresh."""
    first = ask(ngram, "Copy items 10 to 12 exactly as written.")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    answer = tokens(run(ngram, first, params)[0])
    follow = first + answer + ngram.encode_chat([{"role": "user", "content": "And item 13?"}])[1:]
    again = SamplingParams(max_tokens=16, temperature=0.0)
    spec, _ = run(ngram, follow, again)
    fresh, _ = run(EngineCore(CONFIG, loaded_model), follow, again)
    assert tokens(spec) == tokens(fresh) and fresh[-1].num_cached_tokens == 0
    bs = ngram.kv_plan.block_size
    assert spec[-1].num_cached_tokens >= (len(first) + len(answer)) // bs * bs - bs


def test_int8_kv_drafts_stay_within_a_block_and_give_the_same_tokens(loaded_model) -> None:  # type: ignore[no-untyped-def]
    quant = replace(CONFIG, kv_dtype="int8")
    off, ngram = (
        EngineCore(quant, loaded_model),
        EngineCore(replace(quant, speculative="ngram"), loaded_model),
    )
    prompt = ask(off, "Copy items 5 to 7 exactly as written.")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, _ = run(off, prompt, params)
    spec, _ = run(ngram, prompt, params)
    assert tokens(spec) == tokens(plain) and spec[-1].num_accepted_tokens > 0


def test_a_full_batch_does_not_draft(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(CONFIG, speculative="ngram", speculative_max_running=1), loaded_model)
    prompt = ask(core, "Copy item 3 exactly as written.")
    for rid in ("a", "b"):
        core.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while core.has_work():
        core.step()
    assert core.stats().spec_draft_tokens == 0
