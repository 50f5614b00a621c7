"""Verifying drafts at once (one sampler call) against in order (one call per position): the same
kept tokens, logprobs and token lists for greedy, seeded, filtered and penalized rows, with all,
some or none of their drafts accepted, beside rows with no drafts and rows with a grammar."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import xgrammar as xgr

from cloud.engine.sampling.sampler import Sampler, SampleRow, SamplingBatch, param_row
from cloud.engine.speculative.verify import sample_positions
from shared.engine_types import SampleResult, SamplingParams

VOCAB = [chr(i) for i in range(32, 127)] + [""]  # printable ASCII, one char a token; then the stop token
EOS = len(VOCAB) - 1
V = len(VOCAB)
# at once is for devices: on a GPU machine the comparison runs there too (sampler kernels per device)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

Verify = Callable[..., list[list[SampleResult]]]
sample_positions_at_once: Verify = partial(sample_positions, at_once=True)
sample_positions_in_order: Verify = partial(sample_positions, at_once=False)


class CountingSampler(Sampler):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        self.calls += 1
        return super().__call__(logits, batch)


@dataclass
class Case:
    """A row to verify: its parameters, tokens so far, and how many of its drafts are to be right."""

    params: SamplingParams
    tokens: list[int]
    prompt: int
    num_drafts: int
    accepted: int  # <= num_drafts
    grammar: xgr.CompiledGrammar | None = None

    def row(self, rid: str) -> SampleRow:
        return SampleRow(rid, self.params, self.grammar, list(self.tokens), self.prompt)


@dataclass
class Run:
    kept: list[list[SampleResult]]
    rows: list[SampleRow]
    sampler: CountingSampler


def _verify(
    verify: Verify, cases: list[Case], logits: torch.Tensor, drafts: list[list[int]], names: list[str]
) -> Run:
    """`verify` over fresh rows and a fresh sampler (a grammar's matcher starts from nothing)."""
    rows = [c.row(n) for c, n in zip(cases, names, strict=True)]
    values = [param_row(c.params) for c in cases]
    dev = logits.device
    floats = torch.tensor([v[0] for v in values], dtype=torch.float32, device=dev).view(-1, 3)
    ints = torch.tensor([v[1] for v in values], dtype=torch.long, device=dev).view(-1, 2)
    steps = torch.tensor([len(c.tokens) - c.prompt for c in cases], dtype=torch.long, device=dev)
    counts = [len(d) + 1 for d in drafts]
    sampler = CountingSampler()
    kept = verify(sampler, logits, rows, counts, drafts, floats, ints, steps)
    return Run(kept, rows, sampler)


def _drafts(cases: list[Case], logits: torch.Tensor, g: torch.Generator) -> list[list[int]]:
    """Each case's drafts: the reference's own tokens for the first `accepted`, then a miss, then
    noise. Position p's token depends only on the drafts before it, so they are found in turn."""
    out, at = [], 0
    for i, case in enumerate(cases):
        mine = logits[at : at + case.num_drafts + 1]
        drafts = torch.randint(0, V, (case.num_drafts,), generator=g).tolist()
        for p in range(case.num_drafts):
            token = _verify(sample_positions_in_order, [case], mine, [drafts], [f"r{i}"]).kept[0][p].token_id
            drafts[p] = token if p < case.accepted else (token + 1) % V
            if p >= case.accepted:
                break
        out.append(drafts)
        at += case.num_drafts + 1
    return out


def _same_as_the_reference(cases: list[Case], logits: torch.Tensor, drafts: list[list[int]]) -> Run:
    """The run at once, checked against the run in order: the same results exactly, each row
    keeping its right drafts and the token after them, its token list grown by what it kept."""
    names = [f"r{i}" for i in range(len(cases))]
    ref = _verify(sample_positions_in_order, cases, logits, drafts, names)
    got = _verify(sample_positions_at_once, cases, logits, drafts, names)
    assert got.kept == ref.kept  # tokens, logprobs, top logprobs, rejections
    for case, kept, row in zip(cases, got.kept, got.rows, strict=True):
        assert len(kept) == case.accepted + 1
        assert row.token_ids == case.tokens + [res.token_id for res in kept]
    if any(c.grammar is not None for c in cases):  # each matcher where the reference's is
        zeros = torch.zeros(len(cases), V)
        assert torch.equal(
            got.sampler.grammars.apply(zeros, got.rows)[0], ref.sampler.grammars.apply(zeros, ref.rows)[0]
        )
    return got


def _cases(g: torch.Generator) -> list[Case]:
    def toks(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    filtered = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, seed=8, logprobs=3)
    penalized = SamplingParams(
        temperature=1.2,
        seed=9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        logprobs=0,
    )
    biased = SamplingParams(temperature=0.0, frequency_penalty=0.7, logit_bias={5: 1.5})
    return [  # params, tokens, prompt length, drafts, drafts right
        Case(SamplingParams(temperature=0.0), toks(5), 3, 0, 0),
        Case(SamplingParams(temperature=0.0, logprobs=2), toks(6), 4, 4, 4),
        Case(SamplingParams(temperature=1.0, top_k=20, seed=7), toks(4), 2, 3, 1),
        Case(filtered, toks(7), 7, 4, 4),
        Case(penalized, toks(9), 5, 4, 2),
        Case(biased, toks(3), 1, 2, 0),
        Case(SamplingParams(temperature=1.0, seed=10), toks(2), 2, 0, 0),
        Case(SamplingParams(temperature=0.9, top_k=5, top_p=0.8), toks(8), 3, 3, 3),  # no seed: 0
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_at_once_keeps_exactly_what_in_order_keeps_in_one_call(seed: int, device: str) -> None:
    g = torch.Generator().manual_seed(seed)
    cases = _cases(g)
    logits = (torch.randn(sum(c.num_drafts + 1 for c in cases), V, generator=g) * 2).to(device)
    drafts = _drafts(cases, logits, g)
    assert _same_as_the_reference(cases, logits, drafts).sampler.calls == 1
    at = 0
    for case, d in zip(cases, drafts, strict=True):  # each alone: a lone request's views
        mine = logits[at : at + len(d) + 1]
        assert _same_as_the_reference([case], mine, [d]).sampler.calls == 1
        at += len(d) + 1


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 1.0}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.3}]
)
@pytest.mark.parametrize("device", DEVICES)
def test_a_draft_is_penalized_at_the_positions_after_it(penalty: dict[str, float], device: str) -> None:
    """Token 3 leads at positions 0 and 1; drafted at 0, its penalty at 1 lets token 4 win there."""
    logits = torch.zeros(3, V)
    logits[0, 3] = logits[1, 3] = 5.0
    logits[1, 4] = 4.5
    case = Case(SamplingParams(temperature=0.0, **penalty), [1, 2], 1, 2, 1)  # type: ignore[arg-type]
    got = _same_as_the_reference([case, case], torch.cat([logits, logits]).to(device), [[3, 3], [3, 3]])
    assert [[res.token_id for res in kept] for kept in got.kept] == [[3, 4], [3, 4]]


@pytest.mark.parametrize("device", DEVICES)
def test_position_p_draws_the_noise_of_step_plus_p(device: str) -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.zeros(7, V, device=device)  # flat: the draw is the noise's alone
    # what decoding draws at steps 2 .. 8 (without penalties the tokens only count the steps)
    draws = [
        _verify(sample_positions_in_order, [Case(params, [0] * (3 + p), 1, 0, 0)], logits[:1], [[]], ["r"])
        .kept[0][0]
        .token_id
        for p in range(7)
    ]
    assert len(set(draws)) > 1
    got = _same_as_the_reference([Case(params, [0] * 3, 1, 6, 6)], logits, [draws[:6]])
    assert [res.token_id for res in got.kept[0]] == draws


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), max_threads=1)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_a_grammar_walk_on_in_turn_beside_rows_in_one_call(
    compiler: xgr.GrammarCompiler, device: str
) -> None:
    pairs = compiler.compile_regex("(ab|cd|ef)+")  # the allowed tokens tell where the matcher is
    g = torch.Generator().manual_seed(5)
    cases = [
        Case(SamplingParams(temperature=0.0), [1, 2, 3], 3, 3, 2, pairs),
        Case(SamplingParams(temperature=1.0, top_k=8, seed=4, logprobs=1), [4, 5], 2, 4, 1),
        Case(SamplingParams(temperature=1.0, seed=2, constrained_logprobs=True), [6], 1, 3, 3, pairs),
        Case(SamplingParams(temperature=0.0), [7, 8], 2, 0, 0, pairs),
        Case(SamplingParams(temperature=0.0, presence_penalty=2.0), [9], 1, 4, 4),
        Case(SamplingParams(temperature=0.0, frequency_penalty=0.5), [3], 1, 2, 0, pairs),
    ]
    logits = torch.randn(sum(c.num_drafts + 1 for c in cases), V, generator=g) * 2
    logits[:, EOS] = -50.0  # the pattern never ends: every position has a draft to check
    logits = logits.to(device)
    drafts = _drafts(cases, logits, g)
    # position 0 of every row, then positions 1 .. 3 of the grammar row that kept all its drafts
    assert _same_as_the_reference(cases, logits, drafts).sampler.calls == 4


def test_on_the_host_no_position_past_a_miss_is_sampled() -> None:
    """The host has no sync to save: there sample_positions goes in order, a call per kept position."""
    case = Case(SamplingParams(temperature=0.0), [1, 2], 1, 4, 1)
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    drafts = _drafts([case], logits, torch.Generator().manual_seed(1))
    run = _verify(sample_positions, [case], logits, drafts, ["r"])
    assert run.sampler.calls == 2 and len(run.kept[0]) == 2
