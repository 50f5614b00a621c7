"""Greedy agreement of a fast weight path with the exact reference path (`--dtype float32
--weight-quant none`, itself held equal to transformers by the tests): over a set of chat prompts,
how many greedy continuations are identical, and how long the common prefix is when they are not.
Both engines run in this process on the same loaded model."""

from __future__ import annotations

import sys
from dataclasses import replace

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import load_model
from shared.engine_types import SamplingParams

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "Give me three tips for a job interview.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Translate 'good morning, how are you?' into French.",
    "List five animals that live in the ocean.",
    "What causes the seasons on Earth?",
    "Write a short email asking for a day off.",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Describe a sunset over the sea.",
    "Why is the ocean salty?",
    "Name the planets of the solar system in order.",
    "What is the difference between weather and climate?",
    "Give a recipe for pancakes.",
    "What is machine learning?",
)


# Long prompts, so that prefill-sized steps (where kernels for many tokens run) shape the answer too.
DOC_QUESTIONS = (
    "Who is on the throne of England?",
    "What season is named in the text?",
    "Summarise the passage in one sentence.",
    "What contrasts does the author draw?",
    "Which countries are mentioned?",
    "What is the mood of this passage?",
    "Rewrite the first sentence in modern English.",
    "How many times does the word 'age' appear?",
    "What might happen next in the story?",
    "Give the passage a title.",
)


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        core.add_request(
            f"a{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"a{i}"] for i in range(len(prompts))]


def run(config: EngineConfig, max_tokens: int = 64) -> dict[str, object]:
    loaded = load_model(config.model)
    reference = EngineCore(replace(config, dtype="float32", weight_quant="none"), loaded)
    from cloud.bench.engine_bench import TEXT

    doc = TEXT * 3
    prompts = [reference.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    prompts += [reference.encode_chat([{"role": "user", "content": f"{doc}\n{q}"}]) for q in DOC_QUESTIONS]
    print(f"[agreement] reference path on {len(prompts)} prompts x {max_tokens} tokens", file=sys.stderr)
    want = _greedy(reference, prompts, max_tokens)
    del reference
    candidate = EngineCore(config, loaded)
    print(f"[agreement] candidate path: {candidate.weight_plan.describe()}", file=sys.stderr)
    got = _greedy(candidate, prompts, max_tokens)
    prefixes = []
    for a, b in zip(want, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(n)
    return {
        "candidate": {"dtype": config.run_dtype, "weights": candidate.weight_plan.describe()},
        "prompts": len(prompts),
        "tokens_per_prompt": max_tokens,
        "identical_sequences": sum(p == max_tokens for p in prefixes),
        "mean_common_prefix_tokens": round(sum(prefixes) / len(prefixes), 1),
        "token_agreement": round(sum(prefixes) / (len(prefixes) * max_tokens), 3),
    }
