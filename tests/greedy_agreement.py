"""Greedy runs that need not be equal token for token, held to a stricter rule than a share of equal tokens:
before the two sequences part, the sampled tokens' logprobs agree closely, and they may part only at a near-tie:
for a token among the reference's top logprobs there, within a small gap of its best (a wrong value, such as a
wrong KV block, moves logits by their spread). bfloat16 logits are coarse (steps of 1/16 near 10), so a near-tie
may hold three or more tokens: ask for ``logprobs >= 2`` (more to see deeper ties).

Against transformers in float32 (``assert_transformers_greedy``) the rule is the same with a near-tie of float32's
own noise, checked in transformers' logits: tokens equal, or parted once where its best two were that close."""

from __future__ import annotations


def parting(got, expected) -> tuple[int, float, float | None]:
    """(where the sequences part (their length if never), the largest logprob drift before it, the gap there
    between the reference's best token and the one taken instead (None if never)); AssertionError where they
    part for a token outside the reference's top logprobs."""
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
    # (the reference's own token is its best, or tied with it: top's order among equal logprobs is arbitrary)
    top = expected.logprobs[n].top
    taken = dict(top).get(got.token_ids[n])
    assert taken is not None, (
        f"parted at {n} for {got.token_ids[n]}, not among the reference's top tokens {top}"
    )
    return n, drift, max(logprob for _, logprob in top) - taken


def assert_agree(got: list, expected: list, drift: float, near_tie: float) -> list[tuple]:
    """Every pair of outputs by ``parting``: first tokens equal, logprobs within ``drift`` nats before a
    parting, partings only for a token within ``near_tie`` nats of the reference's best. Returns the partings
    (for the log)."""
    partings = [parting(g, e) for g, e in zip(got, expected, strict=True)]
    print("(parted at, logprob drift, gap to the reference's best) per sequence:", partings)
    assert all(n > 0 for n, _, _ in partings), ("every first token agrees", partings)
    assert max(d for _, d, _ in partings) <= drift, partings
    assert all(gap is None or gap <= near_tie for _, _, gap in partings), partings
    return partings


# float32 on both sides, yet summed in different orders (the engine's kernels and transformers', and torch, oneDNN
# and MKL each pick their code path from the CPU): logits differ by about 1e-5 of their size, so two tokens that
# close may swap places on one CPU and not on the next, and nothing else may
FLOAT32_NEAR_TIE = 1e-3


def assert_transformers_greedy(
    hf_model, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]
) -> list[tuple[int, float]]:
    """Each run's tokens equal transformers' greedy ones (``expected``, from tests/conftest.py's ``hf_greedy``), or
    part from them once, for a token within ``FLOAT32_NEAR_TIE`` nats of transformers' best there (its logits
    recomputed over the shared prefix); after a parting the runs follow different prefixes and are not
    compared. Returns the partings: (token index, gap in nats)."""
    import torch

    partings = []
    for prompt, tokens, reference in zip(prompts, got, expected, strict=True):
        assert len(tokens) == len(reference), (len(tokens), len(reference))
        n = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
        if n is None:
            continue
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + reference[:n]])).logits[0, -1].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        gap = float(logprobs[reference[n]] - logprobs[tokens[n]])
        assert gap <= FLOAT32_NEAR_TIE, (
            f"parted from transformers at token {n}: {tokens[n]} is {gap:.2e} nats below its "
            f"{reference[n]} (prompt {prompt[:8]}...)"
        )
        partings.append((n, gap))
    print("partings from transformers' greedy tokens (token index, gap in nats):", partings)
    return partings
