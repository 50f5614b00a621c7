"""RULER's task families (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", 2024), written for this benchmark over its own prose and word lists:
- needle (S-NIAH): one magic number for one subject;
- multikey (MK-NIAH): magic numbers for four subjects; the question asks for one of them;
- multivalue (MV-NIAH): four magic numbers for one subject; the question asks for all four;
- vartrack (variable tracking): a chain of five variables (`VAR QHJZK = 12345.`, then
  `VAR MXTAB = VAR QHJZK.`, ...) and a distractor chain with another value; the question asks for
  every variable that holds the first chain's value;
- cwe (common-word extraction): a numbered list of words, ten of them COMMON_RATIO times as frequent
  as any other; the question asks for those ten.

Placement: the needle the question asks about goes at the spec's depth (multikey: the asked
subject's; multivalue: the first value; vartrack: the chain's first assignment). The others go at
depths drawn from the case's random stream: multikey's distractors and multivalue's other values
anywhere; vartrack's later hops between the first assignment's depth and the end, in chain order;
the distractor chain anywhere, in its order. cwe has no needle: its depth only picks another list.

The answers of multivalue, vartrack and cwe are lists: those tasks ask for more new tokens than a
single number needs (Draft.answer_tokens; SmolLM2's tokenizer spends a token per digit).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from .longctx_draft import Draft, Encoder, Haystack, HaystackMaker, Needle, depths, prose, sentence_haystack
from .longctx_words import ADJECTIVES, NOUNS, VERBS

MULTIKEYS = 4  # the asked subject and three distractors (RULER's niah_multikey_1)
MULTIVALUES = 4  # RULER's MV-NIAH
HOPS = 4  # assignments after the first: a chain of five variables (RULER's default)
COMMON_WORDS = 10  # RULER's cwe
# a common word is this many times as frequent as any other word of the list, at every length
# (RULER's 30 to 3); the list's length sets the other words' count, the fewest the word pool allows
COMMON_RATIO = 10

# four 7-digit numbers at a token per digit take ~36 tokens with commas, ~44 as lines of a list
# ("\n- 2779312"), as SmolLM2 writes them
MULTIVALUE_ANSWER_TOKENS = 56
# five names of five capitals take ~30 tokens with commas (RULER generates 30); a small model often
# restates the assignments instead ("VAR UCOZF = VAR NEKND", ~12 tokens a line)
VARTRACK_ANSWER_TOKENS = 64
# ten words take ~30 tokens with commas, ~40 as lines of a list, ~50 numbered
CWE_ANSWER_TOKENS = 60
_SLACK = 32  # tokens the fitting of a word list may move at the template's seams, either way

_MAGIC_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
# cwe's words: single words of the haystack's lists, each once (some nouns are adjectives too)
_WORD_POOL = tuple(dict.fromkeys(w for w in (*NOUNS, *ADJECTIVES, *VERBS) if " " not in w))


def _magic(subject: str, number: str, depth: int) -> Needle:
    return Needle(f"One of the special magic numbers for {subject} is: {number}.", depth)


def _subjects(rng: random.Random, n: int) -> list[str]:
    """n "adjective-noun" subjects that share no word."""
    return [f"{a}-{b}" for a, b in zip(rng.sample(ADJECTIVES, n), rng.sample(NOUNS, n), strict=True)]


def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    return [str(x) for x in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def needle(rng: random.Random, depth: int) -> Draft:
    # the draws, in this order, are those the needle task always made: its cases stay as they were
    subject = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    key = str(rng.randint(1_000_000, 9_999_999))
    return Draft(
        _MAGIC_INTRO,
        f"What is the special magic number for {subject} mentioned in the provided text?",
        f"The special magic number for {subject} mentioned in the provided text is",
        (_magic(subject, key, depth),),
        sentence_haystack(prose(rng)),
        key,
        subject,
        (key,),
    )


def multikey(rng: random.Random, depth: int) -> Draft:
    subjects, numbers = _subjects(rng, MULTIKEYS), _numbers(rng, MULTIKEYS)
    at = depths(rng, MULTIKEYS - 1)
    others = [_magic(s, n, d) for s, n, d in zip(subjects[1:], numbers[1:], at, strict=True)]
    subject, key = subjects[0], numbers[0]
    return Draft(
        _MAGIC_INTRO,
        f"What is the special magic number for {subject} mentioned in the provided text?",
        f"The special magic number for {subject} mentioned in the provided text is",
        (_magic(subject, key, depth), *others),
        sentence_haystack(prose(rng)),
        key,
        subject,
        (key,),
        distractors=tuple(numbers[1:]),
    )


def multivalue(rng: random.Random, depth: int) -> Draft:
    (subject,), numbers = _subjects(rng, 1), _numbers(rng, MULTIVALUES)
    at = [depth, *depths(rng, MULTIVALUES - 1)]
    return Draft(
        _MAGIC_INTRO,
        f"What are all the special magic numbers for {subject} mentioned in the provided text?",
        f"The special magic numbers for {subject} mentioned in the provided text are",
        tuple(_magic(subject, n, d) for n, d in zip(numbers, at, strict=True)),
        sentence_haystack(prose(rng)),
        ",".join(numbers),
        subject,
        tuple(numbers),
        answer_tokens=MULTIVALUE_ANSWER_TOKENS,
    )


def _variables(rng: random.Random, n: int) -> list[str]:
    """n distinct names of five capital letters (no haystack word is in capitals)."""
    names: dict[str, None] = {}
    while len(names) < n:
        names["".join(rng.choices(string.ascii_uppercase, k=5))] = None
    return list(names)


def _chain(names: list[str], value: str, at: list[int]) -> list[Needle]:
    first = Needle(f"VAR {names[0]} = {value}.", at[0])
    hops = zip(names[:-1], names[1:], at[1:], strict=True)
    return [first, *(Needle(f"VAR {b} = VAR {a}.", d) for a, b, d in hops)]


def vartrack(rng: random.Random, depth: int) -> Draft:
    names, (value, other) = _variables(rng, 2 * (HOPS + 1)), _numbers(rng, 2, digits=5)
    chain, decoy = names[: HOPS + 1], names[HOPS + 1 :]
    needles = [
        *_chain(chain, value, [depth, *depths(rng, HOPS, low=depth)]),
        *_chain(decoy, other, depths(rng, HOPS + 1)),
    ]
    return Draft(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.",
        f"Find all variables that are assigned the value {value} in the text above.",
        f"According to the chain(s) of variable assignment in the text above, {HOPS + 1} variables "
        f"are assigned the value {value}, they are:",
        tuple(needles),
        sentence_haystack(prose(rng)),
        ",".join(chain),
        value,
        tuple(chain),
        match="word",
        answer_tokens=VARTRACK_ANSWER_TOKENS,
    )


@dataclass(slots=True)
class WordList:
    """A numbered list, "1. word 2. word ...", one item a unit. Its first k items are the first k
    words of `order`, shuffled: their counts follow from k, their order from k and the seed."""

    order: list[str]  # each common word COMMON_RATIO x rare times, then each other word rare times
    prefix: list[int]  # prefix[k]: tokens of the first k items
    seed: int
    depth: int  # requested; the list has no needle

    def text(self, k: int) -> str:
        words = self.order[:k]
        random.Random(f"{self.seed}/{k}").shuffle(words)
        return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))

    def needle_depth(self, k: int, enc: Encoder) -> float:
        return self.depth / 100


def _word_list(common: list[str], others: list[str], seed: int, depth: int) -> HaystackMaker:
    """A maker of the list. Each other word comes `rare` times, each common word COMMON_RATIO x
    `rare` times, with `rare` the fewest repeats at which the whole pool's list outgrows the tokens:
    the list holds as many distinct words as the pool allows."""

    def make(enc: Encoder, tokens: int, needles: tuple[Needle, ...]) -> Haystack:
        cost = {w: enc.count(f" {w}") for w in (*common, *others)}
        # number[i]: tokens of " {i}."; they add to the word's, as a space separates the two
        number: list[int] = [0]
        rare = 0
        while True:
            rare += 1
            order = [w for w in common for _ in range(COMMON_RATIO * rare)]
            order += [w for w in others for _ in range(rare)]
            while len(number) <= len(order):
                number.append(enc.count(f" {len(number)}."))
            prefix = [0]
            for i, w in enumerate(order, 1):
                prefix.append(prefix[-1] + number[i] + cost[w])
            if prefix[-1] > tokens + _SLACK:
                break
        # every common word in full, or the ten would not be the most common ones
        if prefix[len(common) * COMMON_RATIO * rare] + _SLACK > tokens:
            raise ValueError(f"no room for a list of {COMMON_RATIO * rare} times each common word")
        return WordList(order, prefix, seed, depth)

    return make


def cwe(rng: random.Random, depth: int) -> Draft:
    words = list(_WORD_POOL)
    rng.shuffle(words)
    common, others = words[:COMMON_WORDS], words[COMMON_WORDS:]
    return Draft(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.",
        f"What are the {COMMON_WORDS} most common words in the above list?",
        f"The top {COMMON_WORDS} words that appear most often in the list are:",
        (),
        _word_list(common, others, rng.getrandbits(64), depth),
        ",".join(common),
        None,
        tuple(common),
        match="word",
        answer_tokens=CWE_ANSWER_TOKENS,
    )
