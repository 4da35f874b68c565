"""Greedy runs that need not be equal token for token, held to a stricter rule than a share of equal tokens:
before the two sequences part, the sampled tokens' logprobs agree closely, and they may part only at a near-tie
of the reference's two best tokens, for its second-best (a wrong value, such as a wrong KV block, moves logits by
their spread). Outputs need ``logprobs >= 2``."""

from __future__ import annotations


def parting(got, expected) -> tuple[int, float, float | None]:
    """(where the sequences part (their length if never), the largest logprob drift before it, the reference's
    gap between its two best tokens there (None if never)); AssertionError where they part for any token but
    the reference's second best."""
    n = next(
        (i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b),
        len(expected.token_ids),
    )
    drift = max(
        (abs(a.logprob - b.logprob) for a, b in zip(got.logprobs[:n], expected.logprobs[:n])),
        default=0.0,
    )
    if n == len(expected.token_ids):
        return n, drift, None
    (_, best), (second, runner_up) = expected.logprobs[n].top[:2]
    assert got.token_ids[n] == second, (
        f"parted at {n} for {got.token_ids[n]}, not the reference's second best {second}"
    )
    return n, drift, best - runner_up


def assert_agree(got: list, expected: list, drift: float, near_tie: float) -> list[tuple]:
    """Every pair of outputs by ``parting``: first tokens equal, logprobs within ``drift`` nats before a
    parting, partings only at gaps within ``near_tie`` nats. Returns the partings (for the log)."""
    partings = [parting(g, e) for g, e in zip(got, expected, strict=True)]
    print("(parted at, logprob drift, reference top-2 gap) per sequence:", partings)
    assert all(n > 0 for n, _, _ in partings), ("every first token agrees", partings)
    assert max(d for _, d, _ in partings) <= drift, partings
    assert all(gap is None or gap <= near_tie for _, _, gap in partings), partings
    return partings
