"""Prompt lookup's drafts: what followed the best earlier occurrence of the sequence's end."""

from __future__ import annotations

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.request import Request
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from cloud.engine.speculative.drafts import SpecConfig
from cloud.engine.speculative.ngram import NgramIndex
from shared.engine_types import SamplingParams


def test_the_tokens_after_an_earlier_occurrence_are_drafted() -> None:
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 9, 3, 4]
    assert index.propose(tokens, 3) == [5, 6, 7]
    assert index.propose(tokens, 10) == [5, 6, 7, 9, 9, 3, 4]  # up to the sequence's end


def test_nothing_is_drafted_without_a_match_or_room() -> None:
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4], 3) == []
    assert index.propose([1, 2, 1, 2], 0) == []
    assert index.propose([5], 3) == []


def test_the_longest_agreement_wins_and_a_tie_goes_to_the_latest() -> None:
    # "7 8" follows both "1 7 8 -> 20" and "5 6 7 8 -> 30"; the sequence ends "5 6 7 8"
    tokens = [5, 6, 7, 8, 30, 31, 0, 1, 7, 8, 20, 21, 0, 5, 6, 7, 8]
    assert NgramIndex(2, 4).propose(tokens, 2) == [30, 31]
    # with no longer agreement anywhere, the latest occurrence
    assert NgramIndex(2, 2).propose(tokens, 2) == [20, 21]


def test_the_index_grows_with_the_sequence() -> None:
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3]
    assert index.propose(tokens, 2) == []
    tokens += [9, 1, 2]
    assert index.propose(tokens, 2) == [3, 9]
    tokens += [3, 9, 4, 1, 2]
    assert index.propose(tokens, 2) == [3, 9]  # the latest occurrence on equal agreement


def test_drafting_backs_off_while_the_model_keeps_rejecting_it() -> None:
    """A prediction the output does not follow: after two verifying steps that keep nothing, the
    request decodes plainly for 4 tokens, then for 8 after the next miss."""
    config = SchedulerConfig(4, 64, 8, 1024, speculative=SpecConfig(ngram=False, num_tokens=3, min_n=1))
    s = Scheduler(config, BlockPool(64), 4)
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=64, prediction=(6, 7) * 10))
    s.add(r)
    drafted = []
    for _ in range(1 + 2 + 4 + 1 + 8):
        out = s.schedule()
        drafted.append(out.chunks[0].num_drafts)
        s.update(out, {"r": [7]})  # the model always writes 7: every draft (6 ...) fails at once
    assert [d > 0 for d in drafted] == [False] + [True] * 2 + [False] * 4 + [True] + [False] * 8
    assert r.num_draft_tokens == sum(drafted) and r.num_accepted_tokens == 0 and r.draft_misses == 3
