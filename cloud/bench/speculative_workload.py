"""The workload of `ctxfuse bench speculative` (speculative.py): a ledger of numbered entries made from
the long-context bench's word lists, questions asking for entries word for word, and prompt lookup
replayed over finished answers (what drafting could gain, from the whole context or the prompt alone)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from cloud.bench.longctx_words import ADJECTIVES, ADVERBS, NAMES, NOUNS, PLACES, TIMES, VERBS
from cloud.engine.config import EngineConfig
from cloud.engine.speculative.drafts import draft_count
from cloud.engine.speculative.ngram import NgramIndex
from cloud.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Ledger:
    text: str
    items: tuple[str, ...]  # entry i + 1 is about items[i], e.g. "amber anchor"


def _entry(i: int, rng: random.Random) -> tuple[str, str]:
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    noun, noun2 = rng.sample(NOUNS, 2)
    name, name2 = rng.sample(NAMES, 2)
    place, place2 = rng.sample(PLACES, 2)
    when = rng.choice(TIMES)
    text = (
        f"Entry {i}. The {adj} {noun} was kept by {name} in the {place}. {when[0].upper()}{when[1:]}, "
        f"{name} {rng.choice(ADVERBS)} {rng.choice(VERBS)} it and moved it to the {place2}. "
        f"{name2} noted that the {noun} sat beside the {adj2} {noun2}."
    )
    return f"{adj} {noun}", text


def make_ledger(tokenizer: Tokenizer, doc_tokens: int, seed: int) -> Ledger:
    """Entries until the next would take the text past `doc_tokens` tokens (one entry at least)."""
    rng = random.Random(f"speculative/{seed}")
    items: list[str] = []
    texts: list[str] = []
    used = 0
    while True:
        item, text = _entry(len(texts) + 1, rng)
        used += len(tokenizer.encode(f"\n\n{text}", add_special=False))
        if texts and used > doc_tokens:
            return Ledger("\n\n".join(texts), tuple(items))
        items.append(item)
        texts.append(text)


def questions(ledger: Ledger, count: int, seed: int) -> list[str]:
    """`count` requests for entries drawn at random (each once while there are enough), in two wordings."""
    rng = random.Random(f"speculative/{seed}/questions")
    picks = rng.sample(range(len(ledger.items)), min(count, len(ledger.items)))
    entries = [picks[j % len(picks)] for j in range(count)]
    return [
        f"Copy entry {k + 1} exactly as written."
        if j % 2 == 0
        else f"Copy the entry about the {ledger.items[k]} word for word."
        for j, k in enumerate(entries)
    ]


@dataclass(frozen=True, slots=True)
class Replay:
    drafted: int
    accepted: int
    steps: int  # decode steps: each makes one token and the drafts accepted before it
    tokens: int  # output tokens after the first


def replay(
    prompt: list[int], output: list[int], max_tokens: int, config: EngineConfig, whole: bool
) -> Replay:
    """Prompt lookup replayed over a finished greedy answer, drafting at every step as the engine does
    at low concurrency (greedy output does not depend on the drafts). `whole` False: drafts from the
    prompt alone, what the answer copies of its document."""
    index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
    seq = prompt + output[:1]  # the first token comes from the prefill
    drafted = accepted = steps = 0
    i = 1
    while i < len(output):
        # as the engine bounds it (neither the step's budget nor the context binds in a replay)
        k = draft_count(config.num_speculative_tokens, max_tokens, max_tokens - i, max_tokens)
        draft = index.propose(seq, k) if whole else index.find(prompt, len(prompt), seq, k)
        ok = 0
        while ok < len(draft) and i + ok < len(output) and draft[ok] == output[i + ok]:
            ok += 1
        take = min(ok + 1, len(output) - i)
        seq += output[i : i + take]
        i += take
        steps += 1
        drafted += len(draft)
        accepted += ok
    return Replay(drafted, accepted, steps, max(0, len(output) - 1))
