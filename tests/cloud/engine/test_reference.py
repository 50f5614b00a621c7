"""Our engine against transformers' Llama implementation loaded from the same GGUF (fp32):
logits agree to 1e-3 however the prompt was computed (at once, in chunks, partly from the prefix
cache, after a preemption), and greedy generation is token-for-token the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.cache import KVCache
from shared.engine_types import SamplingParams

from .recording import RecordingSampler

TOL = 1e-3
CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
]
DOC = (
    "The Rhine is a river that begins in the Swiss Alps, forms part of the Swiss-Liechtenstein and "
    "Swiss-Austrian borders, and flows through Germany and the Netherlands into the North Sea. "
) * 3


def make_core(loaded_model, **overrides) -> tuple[EngineCore, RecordingSampler]:  # type: ignore[no-untyped-def]
    # the exact reference path: float32 activations and weights
    base = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=2048)
    config = replace(base, **overrides)
    core = EngineCore(config, loaded_model)
    rec = RecordingSampler()
    core.runner.sampler = rec
    return core, rec


def kv_gib_for_blocks(loaded_model, blocks: int, block_size: int = 16) -> float:  # type: ignore[no-untyped-def]
    c = loaded_model.weights.config
    return (
        blocks
        * block_size
        * KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
        / 2**30
    )


def run_all(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(f"{o.request_id}#{o.index}", []).extend(o.token_ids)
    return tokens


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def check_against_reference(
    hf_model, rec: RecordingSampler, rid: str, prompt: list[int], generated: list[int]
) -> None:  # type: ignore[no-untyped-def]
    """Every recorded step's logits equal transformers' logits at that position of the full sequence."""
    ref = reference_logits(hf_model, prompt + generated)
    steps = rec.logits[rid]
    assert len(steps) == len(generated)
    for i, got in enumerate(steps):
        want = ref[len(prompt) - 1 + i]
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{rid} step {i}: max |logit diff| {diff}"


def generate(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        core.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {k.split("#")[0]: v for k, v in run_all(core).items()}


def chat_ids(core: EngineCore, text: str) -> list[int]:
    return core.encode_chat([{"role": "user", "content": text}])


def test_logits_match_transformers_for_whole_prompts(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    core, rec = make_core(loaded_model)
    prompts = {f"p{i}": chat_ids(core, q) for i, q in enumerate(CHATS)}
    out = generate(core, prompts, max_tokens=4)
    for rid, ids in prompts.items():
        check_against_reference(hf_model, rec, rid, ids, out[rid])


def test_logits_match_when_prompt_is_prefilled_in_chunks(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    core, rec = make_core(loaded_model, max_num_batched_tokens=23)  # odd chunks across block edges
    ids = chat_ids(core, DOC + " Where does the Rhine end?")
    assert len(ids) > 3 * 23
    out = generate(core, {"chunked": ids}, max_tokens=4)
    check_against_reference(hf_model, rec, "chunked", ids, out["chunked"])


def test_logits_match_when_a_capped_long_prefill_shares_its_steps(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    core, rec = make_core(loaded_model, long_prefill_tokens=13)  # the long prompt in 13-token pieces
    prompts = {"long": chat_ids(core, DOC + " Where does the Rhine end?"), "short": chat_ids(core, CHATS[0])}
    out = generate(core, prompts, max_tokens=4)
    for rid, ids in prompts.items():
        check_against_reference(hf_model, rec, rid, ids, out[rid])


def test_logits_match_when_prompt_comes_partly_from_prefix_cache(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    core, rec = make_core(loaded_model)
    first = chat_ids(core, DOC + " Where does the Rhine begin?")
    second = chat_ids(core, DOC + " Which countries does it cross?")
    generate(core, {"first": first}, max_tokens=2)
    out = generate(core, {"second": second}, max_tokens=4)
    assert core.stats().prefix_hit_tokens >= 64
    check_against_reference(hf_model, rec, "second", second, out["second"])


def test_logits_match_after_preemption(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    probe, _ = make_core(loaded_model)
    prompts = {
        "a": probe.encode_chat(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the moon."},
            ]
        ),
        "b": probe.encode_chat(
            [
                {"role": "system", "content": "You are verbose."},
                {"role": "user", "content": "Tell me about the sun."},
            ]
        ),
    }
    # Room for both prompts plus one block: each fits alone, but not both once they grow.
    blocks = sum(-(-len(ids) // 16) for ids in prompts.values()) + 1
    core, rec = make_core(
        loaded_model, kv_cache_memory_gib=kv_gib_for_blocks(loaded_model, blocks), max_model_len=blocks * 16
    )
    out = generate(core, prompts, max_tokens=40)
    assert core.scheduler.num_preemptions >= 1
    assert core.pool.num_free == core.pool.num_blocks
    for rid, ids in prompts.items():
        check_against_reference(hf_model, rec, rid, ids, out[rid])


@pytest.mark.parametrize("question", CHATS)
def test_greedy_64_tokens_identical_to_transformers_generate(loaded_model, hf_model, question: str) -> None:  # type: ignore[no-untyped-def]
    core, _ = make_core(loaded_model)
    ids = chat_ids(core, question)
    core.add_request("g", ids, SamplingParams(max_tokens=64, temperature=0.0))
    ours = run_all(core)["g#0"]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[
            0, len(ids) :
        ].tolist()
    eos = core.tokenizer.eos_ids
    cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
    assert ours == ref[:cut]


def test_batched_generation_equals_each_request_alone(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core, _ = make_core(loaded_model)
    questions = [
        "Hi!",
        "What is 17 times 23?",
        "List the planets of the solar system.",
        "Translate 'good morning' into French and Spanish.",
        "Write a limerick about a cat who loves lasagna and naps in the sun all afternoon.",
        DOC + " Summarise this.",
        "Why do leaves change colour in autumn? Answer like a botanist talking to a curious child.",
        "Give me a one-line tip for writing clean code.",
    ]
    prompts = {f"b{i}": chat_ids(core, q) for i, q in enumerate(questions)}
    assert len({len(p) for p in prompts.values()}) == len(prompts)
    together = generate(core, prompts, max_tokens=24)
    alone_core, _ = make_core(loaded_model, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        alone = generate(alone_core, {rid: ids}, max_tokens=24)
        assert together[rid] == alone[rid], rid


def test_prompt_logprobs_match_transformers_even_when_the_prefix_is_cached(loaded_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    core, _ = make_core(loaded_model, max_num_batched_tokens=29)  # prompt scored across several chunks
    ids = chat_ids(core, DOC + " Where does the Rhine end?")
    generate(core, {"warm": ids}, max_tokens=1)  # the prompt is now in the prefix cache
    core.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    first = next(o for o in run_outputs(core) if o.request_id == "p")
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids)
    assert first.num_cached_tokens == 0  # scoring every prompt token bypasses the cache
    ref = torch.log_softmax(reference_logits(hf_model, ids), dim=-1)
    assert first.prompt_logprobs[0].token_id == ids[0] and first.prompt_logprobs[0].logprob is None
    for pos in range(1, len(ids)):
        res = first.prompt_logprobs[pos]
        assert res.token_id == ids[pos] and len(res.top_logprobs) == 2
        assert abs(res.logprob - ref[pos - 1, ids[pos]].item()) < TOL  # type: ignore[operator]
        assert res.top_logprobs[0][0] == int(ref[pos - 1].argmax())


def run_outputs(core: EngineCore) -> list:  # type: ignore[type-arg]
    outs = []
    while core.has_work():
        outs.extend(core.step())
    return outs
