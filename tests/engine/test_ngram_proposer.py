"""The n-gram proposer (engine/speculative/ngram.py) and the draft length (engine/speculative/draft_length.py),
against their specification: a proposal follows the most recent earlier occurrence of the longest suffix of
MIN_NGRAM to MAX_NGRAM tokens whose follower is known, up to ``max_tokens`` tokens; the acceptance rate is a
decayed geometric estimate; a draft is given only where it raises the step's expected tokens per second.

Expected values come from a brute-force search written here (a scan of every earlier position) or by hand."""

from __future__ import annotations

import random

import pytest

from engine.speculative.draft_length import (
    DECAY,
    PRIOR_ACCEPTED,
    PRIOR_TRIALS,
    Speculation,
    choose_draft_length,
    expected_tokens,
)
from engine.speculative.ngram import INDEX_WINDOW, MAX_NGRAM, MIN_NGRAM, NgramIndex


def brute_force(tokens: list[int], num_known: int, max_tokens: int, start: int = 0) -> list[int]:
    """The specification by scanning: for n from MAX_NGRAM down to MIN_NGRAM, the last position p < num_known
    (a known follower) where tokens[p - n : p] equals the last n known tokens, the gram at or after ``start``
    (where the index begins); the tokens from p on."""
    if max_tokens <= 0:
        return []
    for n in range(min(MAX_NGRAM, num_known), MIN_NGRAM - 1, -1):
        suffix = tokens[num_known - n : num_known]
        for p in range(num_known - 1, start + n - 1, -1):
            if tokens[p - n : p] == suffix:
                return tokens[p : min(p + max_tokens, num_known)]
    return []


def propose(tokens: list[int], max_tokens: int = 4) -> list[int]:
    return NgramIndex().propose(tokens, len(tokens), max_tokens)


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # (1, 2, 3) occurred once, followed by 7; (2, 3) later, followed by 8
    tokens = [1, 2, 3, 7, 9, 2, 3, 8, 5, 1, 2, 3]
    assert propose(tokens) == [7, 9, 2, 3]
    assert propose(tokens) == brute_force(tokens, len(tokens), 4)


def test_most_recent_occurrence_wins():
    # (0, 1, 2) followed by 5, then by 6
    tokens = [0, 1, 2, 5, 0, 1, 2, 6, 0, 1, 2]
    assert propose(tokens, 2) == [6, 0]


def test_the_suffix_itself_is_no_occurrence_its_follower_is_unknown():
    assert propose([4, 5, 6, 7]) == []  # the only (6, 7) is the suffix
    # the earlier (1, 2) at 0 is followed by 1, 2 (the suffix): the proposal stops at the known tokens
    assert propose([1, 2, 1, 2], 4) == [1, 2]


def test_only_known_tokens_are_searched_and_proposed():
    """Tokens past ``num_known`` (drafts appended to token_ids) are neither matched nor proposed."""
    tokens = [1, 2, 3, 1, 2, 9, 9, 9]
    assert NgramIndex().propose(tokens, 5, 4) == [3, 1, 2]
    assert NgramIndex().propose(tokens, 5, 4) == brute_force(tokens, 5, 4)


def test_max_tokens_caps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(tokens, 3) == [3, 4, 5]
    assert propose(tokens, 1) == [3]
    assert propose(tokens, 0) == []


def test_short_inputs_propose_nothing():
    assert propose([]) == []
    assert propose([5]) == []
    assert propose([5, 5]) == []  # the suffix (5, 5) has no earlier occurrence
    assert propose([5, 5, 5]) == [5]


def test_grams_longer_than_max_ngram_are_not_needed_to_match():
    """A suffix longer than MAX_NGRAM tokens matches by its last MAX_NGRAM: the most recent of those wins even
    where an older occurrence matches a longer suffix."""
    long = list(range(10, 10 + MAX_NGRAM + 2))
    tail = long[-MAX_NGRAM:]
    tokens = long + [1] + [0] + tail + [2] + [0] + long
    assert propose(tokens, 1) == [2]


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_proposals_equal_the_brute_force_search(vocab: int):
    rng = random.Random(vocab)
    for _ in range(40):
        tokens = random_tokens(rng, rng.randrange(0, 40), vocab)
        for max_tokens in (1, 3, 8):
            assert propose(tokens, max_tokens) == brute_force(tokens, len(tokens), max_tokens), (
                tokens,
                max_tokens,
            )


def test_an_index_updated_token_by_token_equals_one_built_at_once():
    rng = random.Random(7)
    tokens = random_tokens(rng, 120, 4)
    grown = NgramIndex()
    for num_known in range(1, len(tokens) + 1):
        proposal = grown.propose(tokens, num_known, 5)
        fresh = NgramIndex()
        assert proposal == fresh.propose(tokens, num_known, 5)
        assert proposal == brute_force(tokens, num_known, 5)
        assert grown.last_seen == fresh.last_seen, num_known
        if num_known >= MIN_NGRAM:  # (shorter: nothing to index, propose returns at once)
            assert grown.num_indexed == fresh.num_indexed == num_known


def test_an_update_enters_at_most_its_budget_and_ends_as_one_built_at_once():
    rng = random.Random(3)
    tokens = random_tokens(rng, 100, 5)
    index = NgramIndex()
    for expected in (30, 60, 90, 100, 100):
        index.update(tokens, len(tokens), budget=30)
        assert index.num_indexed == expected
    whole = NgramIndex()
    whole.update(tokens, len(tokens), budget=len(tokens))
    assert index.last_seen == whole.last_seen


def test_a_partly_built_index_knows_only_real_occurrences():
    """Until its index is built, the occurrence it knows of a gram is among the positions entered so far (an
    older one than the latest, here): still a position whose token did follow that gram."""
    tokens = [1, 2, 3] + [9] * 20 + [1, 2, 4] + [8] * 20 + [1, 2]
    index = NgramIndex()
    index.update(tokens, len(tokens), budget=10)  # positions up to 10: the first (1, 2) only
    assert index.last_seen[2][(1, 2)] == 2
    assert tokens[index.last_seen[2][(1, 2)]] == 3
    assert index.num_indexed == 10


def test_a_long_sequence_is_indexed_over_its_last_window():
    """NgramIndex.over covers the last INDEX_WINDOW tokens: a gram seen only before them is not proposed."""
    old, recent = [7, 7, 5, 6], [3, 4, 1, 2]
    filler = [0] * (INDEX_WINDOW - len(recent))
    tokens = old + filler + recent
    index = NgramIndex.over(len(tokens))
    assert index.start == len(old)
    for _ in range(10):  # (an index is built UPDATE_BUDGET positions a call)
        index.update(tokens, len(tokens))
    assert index.num_indexed == len(tokens)
    assert index.propose(tokens + [5, 6], len(tokens) + 2, 2) == []  # (5, 6) only before the window
    assert index.propose(tokens + [3, 4], len(tokens) + 2, 2) == [1, 2]
    assert NgramIndex.over(100).start == 0


@pytest.mark.parametrize("start", [0, 5, 17])
def test_an_index_from_start_equals_the_brute_force_search_from_there(start: int):
    rng = random.Random(start)
    for _ in range(30):
        tokens = random_tokens(rng, rng.randrange(start, start + 40), 3)
        index = NgramIndex(start)
        assert index.propose(tokens, len(tokens), 4) == brute_force(tokens, len(tokens), 4, start)


def with_context(tokens: list[int], context: list[int], max_tokens: int = 4) -> list[int]:
    index = NgramIndex()
    index.update(context, len(context))
    return NgramIndex().propose(tokens, len(tokens), max_tokens, (index, context))


def test_context_supplies_drafts_the_sequence_lacks():
    context = [7, 8, 3, 4, 5, 6, 9]
    # (3, 4) never occurred in the sequence: the context's follower and what comes after it
    assert with_context([1, 2, 3, 4], context) == [5, 6, 9]
    # the context's tokens are proposed past its follower (not capped by the sequence's known tokens)
    assert with_context([3, 4], context, 2) == [5, 6]


def test_context_is_searched_after_the_sequence_for_each_length():
    context = [1, 2, 3, 50, 51]
    # a sequence match of the same length (2) wins over the context's
    assert with_context([2, 3, 40, 41, 2, 3], context) == [40, 41, 2, 3]
    # a longer context match (3) wins over a shorter sequence match (2)
    assert with_context([2, 3, 40, 9, 1, 2, 3], context) == [50, 51]
    # a context without the gram: nothing
    assert with_context([6, 7, 8], context) == []


# ---------------------------------------------------------------- draft length


def test_rate_starts_at_the_prior_and_follows_record_by_hand():
    state = Speculation(NgramIndex())
    assert state.rate == pytest.approx(PRIOR_ACCEPTED / PRIOR_TRIALS)
    state.record(4, 4)  # four successes, no failure
    accepted, trials = 4.0, 4.0
    assert state.rate == pytest.approx((accepted + PRIOR_ACCEPTED) / (trials + PRIOR_TRIALS))
    state.record(3, 1)  # one success, then a miss
    accepted, trials = DECAY * accepted + 1, DECAY * trials + 2
    assert state.rate == pytest.approx((accepted + PRIOR_ACCEPTED) / (trials + PRIOR_TRIALS))
    assert (state.drafted_tokens, state.accepted_tokens) == (7, 5)


def test_rate_falls_towards_zero_when_every_draft_misses():
    state = Speculation(NgramIndex())
    for _ in range(30):
        state.record(2, 0)
    # the decayed trials converge to 1 / (1 - DECAY) failures, no successes
    assert state.rate == pytest.approx(PRIOR_ACCEPTED / (1 / (1 - DECAY) + PRIOR_TRIALS), rel=1e-2)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5


def test_draft_length_at_the_prior_maximises_tokens_per_second_by_hand():
    """One sequence, a step of 1 s, a draft row 0.1 s, rate 0.5: k drafts give (1 + .5 + ... + .5^k) tokens in
    1 + 0.1 k s: 1.36 (k = 1), 1.458 (k = 2), 1.442 (k = 3) tokens/s; k = 2 is best."""
    assert choose_draft_length(Speculation(NgramIndex()), 4, 1.0, 1.0, 0.1) == 2


def confident() -> Speculation:
    state = Speculation(NgramIndex())
    for _ in range(20):
        state.record(4, 4)
    return state


def test_a_high_rate_with_cheap_rows_gets_the_limit():
    assert confident().rate > 0.9
    assert choose_draft_length(confident(), 4, 1.0, 1.0, 0.01) == 4
    assert choose_draft_length(confident(), 3, 1.0, 1.0, 0.01) == 3
    assert choose_draft_length(confident(), 0, 1.0, 1.0, 0.01) == 0


def test_expensive_rows_get_no_drafts():
    # a draft row costing what the whole step does: even a sure draft does not raise tokens per second
    assert choose_draft_length(confident(), 4, 1.0, 1.0, 1.0) == 0
    # a long step of many rows (8 tokens in 8 s): a row costs its share, a draft gains less than a row's token
    assert choose_draft_length(Speculation(NgramIndex()), 4, 8.0, 8.0, 1.0) == 0


def test_drafts_that_keep_missing_get_none():
    # at the prior's rate (0.5) a draft row of 0.2 s pays: 1.5 tokens in 1.2 s
    assert choose_draft_length(Speculation(NgramIndex()), 4, 1.0, 1.0, 0.2) >= 1
    state = Speculation(NgramIndex())
    for _ in range(30):
        state.record(1, 0)
    # at ~0.14 it does not: 1.14 tokens in 1.2 s (the speculator's probe after PROBE_AFTER steps without
    # drafts: tests/engine/test_speculative.py)
    assert [choose_draft_length(state, 4, 1.0, 1.0, 0.2) for _ in range(3)] == [0, 0, 0]
