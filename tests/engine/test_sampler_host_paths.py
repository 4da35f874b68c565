"""The sampler's host paths (CPU tensors): top-k / top-p decided from each row's largest logits, and unseeded rows
drawn through their cumulative distribution. Each is checked against the path every device takes (the whole
row sorted; the exponential race over every token), or against the per-row reference distribution of
tests/engine/test_sampler.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.sample import logits_processors, sampler
from engine.sample.logits_processors import top_k_top_p_from_candidates, top_k_top_p_sorted
from engine.sample.sampler import Sampler, inverse_cdf, seeded_race
from engine.sample.seeded_noise import draw_key, exponential_noise, exponential_noise_at
from engine.sampling_params import SamplingParams
from tests.engine.test_sampler import (
    EOS,
    assert_matches_distribution,
    make_seq,
    random_logits,
    reference_probs,
)

VOCAB = 200


def mixed_filters(
    rows: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows from peaked to flat, each with its own top_k (vocab = off) and top_p (1 = off)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.arange(rows) % 4][:, None]
    logits = torch.randn(rows, vocab, generator=generator) * scale
    top_k = torch.tensor([vocab, 1, 3, 10, 50, 150, vocab - 1, vocab])[torch.arange(rows) % 8]
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.99, 1e-9, 0.75, 1.0])[torch.arange(rows) % 7]
    return logits, top_k[:, None], top_p[:, None]


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [row.isfinite().nonzero().flatten().tolist() for row in logits]


@pytest.mark.parametrize("widths", [(4,), (4, 16), (8, 64), (4, 16, 64), (256,)])
def test_candidates_keep_what_the_whole_row_sort_keeps(widths: tuple[int, ...]) -> None:
    logits, top_k, top_p = mixed_filters(112, VOCAB, seed=1)
    got = top_k_top_p_from_candidates(logits, top_k, top_p, widths)
    expected = top_k_top_p_sorted(logits, top_k, top_p)
    assert kept(got) == kept(expected)
    assert torch.equal(got[got.isfinite()], logits[got.isfinite()])  # the kept logits as they were


def test_rows_with_masked_tokens_keep_what_the_sort_keeps() -> None:
    logits, top_k, top_p = mixed_filters(56, VOCAB, seed=2)
    # a grammar's or min_tokens' mask: most of each row out, a row with fewer allowed tokens than candidates
    logits[:, ::3] = float("-inf")
    logits[5, 4:] = float("-inf")
    got = top_k_top_p_from_candidates(logits, top_k, top_p, (4, 16))
    assert kept(got) == kept(top_k_top_p_sorted(logits, top_k, top_p))


class Calls:
    """How often the candidates' filter and the whole-row sort ran, and with which widths."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.widths: list[int] = []
        self.sorted_rows: list[int] = []
        among, whole = logits_processors.filter_among_largest, logits_processors.top_k_top_p_sorted

        def count_among(logits, top_k, top_p, width, following):
            self.widths.append(width)
            return among(logits, top_k, top_p, width, following)

        def count_sorted(logits, top_k, top_p):
            self.sorted_rows.append(logits.shape[0])
            return whole(logits, top_k, top_p)

        monkeypatch.setattr(logits_processors, "filter_among_largest", count_among)
        monkeypatch.setattr(logits_processors, "top_k_top_p_sorted", count_sorted)


def test_a_peaked_row_is_decided_by_its_largest_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    logits = random_logits(2, VOCAB, seed=3)
    logits[:, 7] = 30.0  # nearly all the mass
    out = logits_processors.apply_top_k_top_p(
        logits, torch.tensor([[VOCAB], [5]]), torch.tensor([[0.9], [1.0]])
    )
    assert calls.widths == [64] and calls.sorted_rows == []
    assert kept(out) == [[7], sorted(logits[1].topk(5).indices.tolist())]


def test_a_long_prefix_goes_on_to_more_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """~120 tokens share the row's mass: not within 64, within 1,024, never sorted."""
    calls = Calls(monkeypatch)
    logits = torch.full((1, 4096), -30.0)
    logits[0, 1000:1120] = torch.linspace(2.0, 0.0, 120)
    out = logits_processors.apply_top_k_top_p(logits, torch.tensor([[4096]]), torch.tensor([[0.9]]))
    assert calls.widths == [64, 1024] and calls.sorted_rows == []
    assert kept(out) == kept(
        top_k_top_p_sorted(logits, torch.tensor([[4096]]), torch.tensor([[0.9]]))
    )


def test_a_flat_row_is_sorted_without_the_wider_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NEXT_LEVEL_MASS of top_p among the first 64: the 1,024 would not end it either; sorted at once."""
    calls = Calls(monkeypatch)
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(4)) * 0.1
    top_k, top_p = torch.tensor([[4096]]), torch.tensor([[0.9]])
    out = logits_processors.apply_top_k_top_p(logits, top_k, top_p)
    assert calls.widths == [64] and calls.sorted_rows == [1]
    assert len(kept(out)[0]) > 1024


def test_cuda_tensors_would_be_sorted_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    monkeypatch.setattr(logits_processors, "decides_on_host", lambda tensor: False)
    logits_processors.apply_top_k_top_p(
        random_logits(2, VOCAB), torch.tensor([[5], [9]]), torch.tensor([[0.9], [1.0]])
    )
    assert calls.widths == [] and calls.sorted_rows == [2]


def test_inverse_cdf_follows_the_distribution_and_never_draws_a_zero() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.0, 0.6, 0.0]) * 3.0  # unnormalised
    tokens = inverse_cdf(probs.expand(20000, -1).contiguous()).tolist()
    assert_matches_distribution(tokens, (probs / probs.sum()).tolist())


def test_inverse_cdf_at_a_draw_of_the_whole_total_takes_a_possible_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The largest float32 below 1 times a total can round to the total: never the trailing zeros."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 1e-3, 0.9, 0.0]])
    monkeypatch.setattr(
        torch, "rand", lambda *shape, **kw: torch.full(shape, 1.0)
    )  # past any float below 1
    assert inverse_cdf(probs).tolist() == [1, 2]


def test_inverse_cdf_repeats_under_torchs_seed() -> None:
    probs = random_logits(16, VOCAB, seed=5).softmax(dim=-1)
    torch.manual_seed(9)
    first = inverse_cdf(probs).tolist()
    torch.manual_seed(9)
    assert inverse_cdf(probs).tolist() == first


@pytest.mark.parametrize("host", [True, False])
def test_sampled_distribution_is_the_same_on_either_path(
    monkeypatch: pytest.MonkeyPatch, host: bool
) -> None:
    """The whole sampler at a vocabulary wider than the candidates (all three filters), by the host's paths or
    by the device's, against the per-row reference."""
    monkeypatch.setattr(logits_processors, "CPU_CANDIDATES", (4, 8))
    if not host:
        monkeypatch.setattr(logits_processors, "decides_on_host", lambda tensor: False)
    torch.manual_seed(0)
    row = random_logits(1, vocab=40, seed=6)[0] * 1.5
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    expected = reference_probs(row.tolist(), 0.8, top_k=20, top_p=0.9, min_p=0.02)
    assert 8 < sum(p > 0 for p in expected) < 20  # past the first candidates, within the top_k
    n = 20000
    seqs = [make_seq(params, seq_id=i) for i in range(n)]
    tokens = Sampler()(row.expand(n, -1).contiguous(), seqs, (EOS,)).token_ids.tolist()
    assert_matches_distribution(tokens, expected)


def test_seeded_and_unseeded_rows_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows keep their race (the same token as alone, as on any device); unseeded rows around them draw
    from their own distribution."""
    races = []
    original = sampler.exponential_noise
    monkeypatch.setattr(sampler, "exponential_noise", lambda *a: races.append(1) or original(*a))
    logits = random_logits(1, vocab=12, seed=7)
    seeded = SamplingParams(temperature=0.9, seed=42)
    alone = Sampler()(logits, [make_seq(seeded)], (EOS,)).token_ids.tolist()
    n = 6000
    params = [seeded if i % 3 == 0 else SamplingParams(temperature=0.9) for i in range(n)]
    seqs = [make_seq(p, seq_id=i) for i, p in enumerate(params)]
    torch.manual_seed(1)
    tokens = Sampler()(logits.expand(n, -1).contiguous(), seqs, (EOS,)).token_ids.tolist()
    assert set(tokens[::3]) == set(alone)
    unseeded = [t for i, t in enumerate(tokens) if i % 3]
    assert_matches_distribution(unseeded, reference_probs(logits[0].tolist(), 0.9))
    assert len(races) == 2 and len(Counter(unseeded)) > 3


def test_a_seeded_race_among_few_tokens_picks_what_the_whole_race_picks() -> None:
    """Rows with a few possible tokens (hashed alone), rows with many (the whole row's noise), in one batch: the
    same token as the race over every token, which every device runs."""
    generator = torch.Generator().manual_seed(8)
    vocab, rows = 400, 64
    probs = torch.rand(rows, vocab, generator=generator)
    keep = torch.rand(rows, vocab, generator=generator) < torch.linspace(0.005, 0.6, rows)[:, None]
    keep[:, 0] = True  # (every row some token)
    probs = probs * keep
    keys = torch.tensor([draw_key(seed, 3) for seed in range(rows)])
    everywhere = (probs / exponential_noise(keys, vocab)).argmax(dim=-1)
    counts = keep.sum(dim=-1)
    assert (counts <= vocab // sampler.SPARSE_RACE).sum() > 10 and (counts > vocab // 4).sum() > 10
    assert torch.equal(seeded_race(probs, keys), everywhere)


def test_noise_at_some_tokens_is_the_whole_tables_there() -> None:
    keys = torch.tensor([draw_key(1, 0), draw_key(2**40, 7), -(2**63)])
    ids = torch.randint(0, 70_000, (3, 50), generator=torch.Generator().manual_seed(9))
    assert torch.equal(
        exponential_noise_at(keys, ids), exponential_noise(keys, 70_000).gather(1, ids)
    )


def test_equal_scores_go_to_the_lowest_id_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the noise all ones, equal probabilities tie: argmax's lowest id, sparse rows as dense ones."""
    monkeypatch.setattr(
        sampler, "exponential_noise", lambda keys, vocab: torch.ones(len(keys), vocab)
    )
    monkeypatch.setattr(sampler, "exponential_noise_at", lambda keys, ids: torch.ones(ids.shape))
    probs = torch.zeros(3, 40)
    probs[0, [31, 7, 12]] = 0.5  # few: sparse
    probs[1, 5:] = 0.25  # many: dense
    probs[1, 3] = 0.25
    probs[2, [39, 38]] = 1.0
    assert seeded_race(probs, torch.tensor([1, 2, 3])).tolist() == [7, 3, 38]
