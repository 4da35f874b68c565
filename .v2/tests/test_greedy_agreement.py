"""tests/greedy_agreement.py's rule, on made-up outputs: equal runs agree; a parting for a token among the
reference's top logprobs within the near-tie gap passes (the second best, or the third in a three-way tie);
a parting for a token outside them, a large gap, a drift before the parting or a different first token fail."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.greedy_agreement import assert_agree, parting


def output(tokens: list[int], tops: list[list[tuple[int, float]]]):
    logprobs = [
        SimpleNamespace(logprob=dict(top).get(token, -9.0), top=top)
        for token, top in zip(tokens, tops)
    ]
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


TOPS = [
    [(5, -0.1), (6, -2.0), (7, -3.0)],
    [(8, -1.00), (9, -1.02), (10, -1.03)],  # a three-way near-tie
    [(11, -0.2), (12, -1.9), (13, -2.5)],
]


def test_equal_runs_agree():
    ref = output([5, 8, 11], TOPS)
    assert parting(ref, ref) == (3, 0.0, None)
    assert assert_agree([ref], [ref], drift=0.1, near_tie=0.1) == [(3, 0.0, None)]


@pytest.mark.parametrize("token", [9, 10])
def test_a_parting_within_a_near_tie_passes(token: int):
    ref = output([5, 8, 11], TOPS)
    got = output([5, token, 11], TOPS)
    ((n, drift, gap),) = assert_agree([got], [ref], drift=0.1, near_tie=0.1)
    assert (n, drift) == (1, 0.0) and gap == pytest.approx(0.02 if token == 9 else 0.03)


def test_an_exact_tie_listed_in_either_order_is_a_near_tie():
    """Two tokens of equal logprob: the reference took one (the lower id), its top list may name the other
    first; a run that takes the other parts at a gap of 0."""
    tied = [TOPS[0], [(9, -1.0), (8, -1.0), (10, -1.5)], TOPS[2]]
    ref, got = output([5, 8, 11], tied), output([5, 9, 11], tied)
    assert assert_agree([got], [ref], drift=0.1, near_tie=0.1) == [(1, 0.0, 0.0)]


def test_partings_outside_the_rule_fail():
    ref = output([5, 8, 11], TOPS)
    with pytest.raises(AssertionError, match="not among"):
        parting(output([5, 99, 11], TOPS), ref)  # outside the reference's top
    with pytest.raises(AssertionError):
        assert_agree([output([5, 8, 12], TOPS)], [ref], drift=0.1, near_tie=0.1)  # a 1.7-nat gap
    with pytest.raises(AssertionError):
        assert_agree([output([6, 8, 11], TOPS)], [ref], drift=0.1, near_tie=5.0)  # first token
    drifted = output([5, 9, 11], TOPS)
    drifted.logprobs[0].logprob = -0.5
    with pytest.raises(AssertionError):
        assert_agree([drifted], [ref], drift=0.1, near_tie=0.1)
