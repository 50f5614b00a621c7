"""The sampler's grammar mask against xgrammar's own: the same logits masked, only constrained rows
touched, and a request's matcher advancing with its tokens."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from cloud.engine.request import Request
from cloud.engine.sampling.grammar_mask import GrammarMasks, allowed_tokens
from shared.engine_types import SamplingParams

VOCAB = [chr(i) for i in range(32, 127)] + [""]  # printable ASCII, one char a token; then the stop token
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), max_threads=1)


@pytest.mark.parametrize("vocab", [31, 32, 33, 150, 49152])
def test_unpacked_bitmask_masks_exactly_as_xgrammar_does(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab)
    assert torch.equal(torch.where(allowed_tokens(bitmask, vocab), logits, float("-inf")), reference)


def _request(rid: str, grammar: xgr.CompiledGrammar | None) -> Request:
    return Request(rid, [0], SamplingParams(), grammar=grammar)


def test_only_constrained_rows_are_masked_each_by_its_own_grammar(compiler: xgr.GrammarCompiler) -> None:
    digits = compiler.compile_json_schema(json.dumps({"type": "integer"}), any_whitespace=False)
    boolean = compiler.compile_json_schema(json.dumps({"type": "boolean"}), any_whitespace=False)
    requests = [_request("a", digits), _request("free", None), _request("b", boolean)]
    logits = torch.randn(3, len(VOCAB))
    masks = GrammarMasks()
    masked, rows = masks.apply(logits, requests)
    assert rows == [0, 2]
    assert torch.equal(masked[1], logits[1])
    allowed = [{VOCAB[i] for i in range(len(VOCAB)) if masked[r, i] > float("-inf")} for r in (0, 2)]
    assert allowed[0] == set("-0123456789") and allowed[1] == {"t", "f"}
    for r in (0, 2):  # what stays is untouched
        keep = masked[r] > float("-inf")
        assert torch.equal(masked[r][keep], logits[r][keep])


def test_matchers_advance_with_accepted_tokens_and_refuse_others(compiler: xgr.GrammarCompiler) -> None:
    boolean = compiler.compile_json_schema(json.dumps({"type": "boolean"}), any_whitespace=False)
    req = _request("b", boolean)
    masks = GrammarMasks()
    for ch in "tru":
        assert masks.accept(req, VOCAB.index(ch))
    logits, _ = masks.apply(torch.zeros(1, len(VOCAB)), [req])
    assert [VOCAB[i] for i in range(len(VOCAB)) if logits[0, i] == 0] == ["e"]
    assert not masks.accept(req, VOCAB.index("x"))
    masks.forget("b")  # a new matcher starts from the beginning
    assert masks.accept(req, VOCAB.index("f"))
