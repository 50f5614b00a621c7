"""The context overflow policies as plain decisions: what truncate_middle keeps, which requests
slide, what an unset max_tokens becomes, and the ring a sliding request keeps."""

from __future__ import annotations

import pytest

from cloud.engine.scheduling.overflow import OverflowPolicy
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError


def test_truncate_middle_keeps_head_and_tail_in_equal_shares() -> None:
    policy = OverflowPolicy("truncate_middle", 10, 4, 0, 2)
    prompt = list(range(20))
    kept, dropped = policy.fit(prompt, SamplingParams(max_tokens=4))
    assert kept == [0, 1, 2, 17, 18, 19] and dropped == 14
    assert policy.fit(list(range(6)), SamplingParams(max_tokens=4)) == (list(range(6)), 0)  # fits
    with pytest.raises(ContextLengthExceededError):
        policy.fit(prompt, SamplingParams(max_tokens=9))


def test_error_policy_never_truncates_and_only_sliding_runs_any_length() -> None:
    error = OverflowPolicy("error", 10, 4, 0, 2)
    assert error.fit(list(range(20)), SamplingParams(max_tokens=4)) == (list(range(20)), 0)
    assert not error.any_length and not error.slides(20, 4)
    sliding = OverflowPolicy("sliding_window", 64, 16, 8, 4)
    assert sliding.any_length and sliding.slides(60, 5) and not sliding.slides(60, 4)
    assert (sliding.sink_blocks, sliding.ring_blocks) == (2, 12)


def test_unset_max_tokens_leaves_room_for_an_answer_when_the_prompt_is_too_long() -> None:
    assert OverflowPolicy("error", 800, 64, 0, 16).default_max_tokens(790) == 10
    assert OverflowPolicy("error", 800, 64, 0, 16).default_max_tokens(900) == 1  # refused later
    assert OverflowPolicy("truncate_middle", 800, 64, 0, 16).default_max_tokens(790) == 100


def test_a_ring_too_small_for_the_sinks_is_refused_at_start() -> None:
    with pytest.raises(InvalidRequestError, match="sliding_window needs a context"):
        OverflowPolicy("sliding_window", 256, 224, 64, 16)


def test_drop_old_turns_is_error_to_the_engine_its_turns_went_before_tokenizing() -> None:
    policy = OverflowPolicy("drop_old_turns", 800, 64, 0, 16)
    assert policy.fit(list(range(900)), SamplingParams(max_tokens=4)) == (list(range(900)), 0)
    assert not policy.any_length
    assert policy.default_max_tokens(790) == 10  # the prompt's room, as under error
