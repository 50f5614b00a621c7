"""The prompts a bench sends: random words, one long shared document with varied questions, or the
conversations of a ShareGPT-like file (gateway/bench/serving/sharegpt.py).

Lengths are counted in words, a stand-in for tokens that needs no tokenizer: WORDS are common words
of about one token each (9,000 of them made 9,030 SmolLM2 tokens with the chat template), while free
text, as in a file, runs nearer 1.3 tokens per word. The servers' usage chunks give the true counts.

Every builder returns exactly the number of prompts asked for, all distinct where the source allows,
so that each run of a sweep gets prompts of its own and none finds another run's prompts cached.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec

from gateway.bench.serving.options import DEFAULT_OUTPUT_LEN, ServeBenchOptions

_WORD_TEXT = """the of and to in is was for on that with as by at from his her they this have are not but had
    which one all were when there can an been has more their if will would into time only new some
    could these two may first then do any like my now over such our man me even most made after also
    did many before must through back years where much your way well down should because each just
    those people how too little state good very make world still own see men work long get here
    between both life being under never day same another know while last might us great old year off
    come since against go came right used take three house water river city light music garden
    window table paper morning evening mountain forest letter road story bridge market school"""
WORDS = tuple(_WORD_TEXT.split())
QUESTIONS = (
    "In one sentence, what does the document say about {a}?",
    "Where does the word {a} first appear in the document, and what comes after it?",
    "Does the document mention {a} before {b}? Answer briefly.",
    "Summarise the part of the document around {a} and {b}.",
    "List three words that appear near {a} in the document.",
)


class Prompt(msgspec.Struct, frozen=True):
    text: str
    input_words: int  # the prompt's length in words: its token count when the server reports none
    output_len: int  # max_tokens


def sample_len(rng: random.Random, mean: int, ratio: float) -> int:
    """A length drawn uniformly from [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    if ratio == 0:
        return mean
    return rng.randint(max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio))))


def random_prompts(n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        words, out = sample_len(rng, input_len, ratio), sample_len(rng, output_len, ratio)
        prompts.append(Prompt(" ".join(rng.choices(WORDS, k=words)), words, out))
    return prompts


def long_doc_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
    """One document of `input_len` words shared by every prompt, then a short question of its own:
    after the first request, a server with prefix caching prefills only the question."""
    rng = random.Random(seed)
    words = rng.choices(WORDS, k=input_len)
    # sentences of 12 words, so the document reads as text rather than one endless line
    document = ". ".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)) + "."
    prompts = []
    for i in range(n):
        a, b = rng.sample(WORDS, 2)
        question = f"Question {i + 1}: " + rng.choice(QUESTIONS).format(a=a, b=b)
        prompts.append(Prompt(f"{document}\n\n{question}", input_len + len(question.split()), output_len))
    return prompts


def build_prompts(options: ServeBenchOptions, n: int) -> list[Prompt]:
    """`n` prompts from the options' dataset (raises ValueError for a file that yields none)."""
    output_len = options.output_len or DEFAULT_OUTPUT_LEN
    if options.dataset == "random":
        return random_prompts(n, options.input_len, output_len, options.range_ratio, options.seed)
    if options.dataset == "long-doc":
        return long_doc_prompts(n, options.input_len, output_len, options.seed)
    from gateway.bench.serving.sharegpt import file_prompts

    return file_prompts(Path(options.dataset), n, options.output_len, options.seed)
