"""`ctxfuse bench step-profile` in process, on a few tokens: every part is there and adds up to the
step, and the timers leave the engine as they found it (the same greedy tokens as an engine never
profiled)."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

import kernels.cpu.norm_rope as norm_rope_module
from cloud.bench.step_profile import table
from cloud.bench.step_serving import MODES
from cloud.bench.step_timers import PARTS, PartClock, ProfileOptions, decode, profile_in_process, prompt_text
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.output import TextState
from cloud.model.llama import LlamaModel
from cloud.model.loading import LoadedModel

CONFIG = EngineConfig(kv_cache_memory_gib=0.25)  # the defaults' path, a smaller KV cache
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def core(loaded_model: LoadedModel) -> EngineCore:
    return EngineCore(CONFIG, loaded_model)


def test_a_nested_part_pauses_the_part_it_was_entered_from() -> None:
    clock = PartClock()
    clock.enter("outer")
    clock.enter("inner")
    clock.enter("inner")  # re-entered: still exclusive
    clock.leave()
    clock.leave()
    clock.leave()
    assert set(clock.seconds) == {"outer", "inner"}
    assert all(s >= 0 for s in clock.seconds.values())
    assert math.isclose(sum(clock.seconds.values()), clock.span, rel_tol=1e-9, abs_tol=1e-12)


def test_the_parts_add_up_to_the_step_and_the_engine_is_left_as_it_was(core: EngineCore) -> None:
    text, prompt = prompt_text(core, 40)
    assert text and len(prompt) <= 40
    runner, model = core.runner, core.runner.model
    assert isinstance(model, LlamaModel)  # the default model
    originals = {
        name: getattr(norm_rope_module, name) for name in ("rms_norm", "fused_add_rms_norm", "silu_mul")
    }
    text_add = TextState.__dict__["add"]
    qkv = model.layers[0].qkv
    before, _ = decode(core, prompt, NEW_TOKENS, "before")  # as an engine never profiled generates

    result = profile_in_process(core, prompt, ProfileOptions(new_tokens=NEW_TOKENS, rounds=1, api=False))

    assert list(result.parts_ms) == [p.key for p in PARTS]
    assert all(ms >= 0 for ms in result.parts_ms.values())
    assert result.parts_ms["gemv_gate_up"] > 0 and result.parts_ms["attention"] > 0
    assert math.isclose(sum(result.parts_ms.values()), result.timed_ms, rel_tol=1e-9)
    assert result.steps == NEW_TOKENS - 1  # the prompt's step is no decode step
    assert result.same_tokens
    # every wrapper is gone: instance attributes removed, slots, classes and modules set back
    for owner, name in ((core, "step"), (core, "_emit"), (core.scheduler, "schedule"), (runner, "prepare")):
        assert name not in vars(owner)
    assert model.layers[0].qkv is qkv and TextState.__dict__["add"] is text_add
    assert {name: getattr(norm_rope_module, name) for name in originals} == originals

    after, _ = decode(core, prompt, NEW_TOKENS, "after")
    assert after == before and len(after) == NEW_TOKENS


def test_the_table_shows_every_part_and_the_total(core: EngineCore) -> None:
    _, prompt = prompt_text(core, 24)
    result = profile_in_process(core, prompt, ProfileOptions(new_tokens=3, rounds=1, api=False))

    machine = {
        "model_name": "cpu",
        "cpus": 2,
        "flags": [],
        "gemv_isa": "x",
        "torch_threads": 2,
        "read_gbs": 10.0,
        "load_average": 0.5,
    }
    data = {
        "in_process": asdict(result),
        "modes": [],
        "machine": machine,
        "load_average_end": 0.5,
        "prompt_tokens": 24,
    }
    text = table(data)
    assert all(f"| {p.label} |" in text for p in PARTS)
    assert "| **total** |" in text and "untimed engine step" in text
    assert [m.in_process for m in MODES] == [False, True]
