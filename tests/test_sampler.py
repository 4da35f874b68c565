"""Sampler specification: greedy, penalties, top-k / top-p / min-p, seeds, min_tokens, logprobs.

Expected values come from hand-built logits or from the small per-row references below (plain Python
floats, one row at a time), never from the sampler itself.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.layers.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = 2
VOCAB = 32


# ---------------------------------------------------------------- helpers

def make_seq(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
             seq_id: int = 0) -> Sequence:
    prompt = [5, 6, 7] if prompt is None else prompt
    output = [] if output is None else output
    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=prompt + output, params=params,
                    num_prompt_tokens=len(prompt))


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def sample(logits: torch.Tensor, seqs: list[Sequence], eos: tuple[int, ...] = (EOS,)) -> SamplerOutput:
    return Sampler()(logits, seqs, eos)


def draw_many(row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n independent unseeded draws from one row of logits, as one batch of n identical rows."""
    seqs = [make_seq(params, seq_id=i) for i in range(n)]
    return sample(row.expand(n, -1).contiguous(), seqs).token_ids


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def reference_probs(row: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> list[float]:
    """Temperature, keep top_k, then the shortest prefix reaching top_p, then min_p; renormalised."""
    probs = softmax([v / temperature for v in row])
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    kept_mass = sum(probs[i] for i in kept)
    prefix, mass = [], 0.0
    for i in kept:
        prefix.append(i)
        mass += probs[i] / kept_mass
        if mass >= top_p:
            break
    kept = [i for i in prefix if probs[i] >= min_p * probs[prefix[0]]]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(row))]


def assert_matches_distribution(tokens: list[int], expected: list[float]) -> None:
    """Never a zero-probability token; chi-square over the rest within a wide (p ~ 1e-6) bound."""
    counts = Counter(tokens)
    assert all(expected[t] > 0 for t in counts), "drew a token with zero probability"
    support = [i for i, p in enumerate(expected) if p > 0]
    n = len(tokens)
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    dof = max(len(support) - 1, 1)
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 10, f"chi2={chi2:.1f} with {dof} degrees of freedom"


def hand_penalised(row: list[float], prompt: list[int], output: list[int], repetition: float,
                   frequency: float, presence: float) -> list[float]:
    counts = Counter(output)
    result = []
    for token, logit in enumerate(row):
        if token in prompt or token in counts:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * counts[token] + presence * (1 if counts[token] else 0)
        result.append(logit)
    return result


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # lowest index among ties


# ---------------------------------------------------------------- greedy

def test_greedy_equals_argmax() -> None:
    logits = random_logits(6)
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(6)]
    out = sample(logits, seqs)
    assert out.token_ids == [argmax(row) for row in logits.tolist()]
    assert out.logprobs == [None] * 6


def test_greedy_ties_pick_the_lowest_index() -> None:
    logits = random_logits(1)
    logits[0, 9] = logits[0, 21] = logits.max() + 1.0
    assert sample(logits, [make_seq(SamplingParams(temperature=0.0))]).token_ids == [9]
    with_logprobs = make_seq(SamplingParams(temperature=0.0, logprobs=1))  # the slower path agrees
    assert sample(logits, [with_logprobs]).token_ids == [9]


def test_repetition_penalty_divides_positive_logits_of_seen_tokens() -> None:
    logits = random_logits(1)  # values within about +-3
    logits[0, 10], logits[0, 11] = 10.0, 6.0
    seen_in_prompt = make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[10, 4])
    assert sample(logits, [seen_in_prompt]).token_ids == [11]  # 10 / 2 = 5 < 6
    seen_in_output = make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[10])
    assert sample(logits, [seen_in_output]).token_ids == [11]
    mild = make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[10])
    assert sample(logits, [mild]).token_ids == [10]  # 10 / 1.5 = 6.67 > 6


def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = -random_logits(1).abs() - 2.0  # every logit <= -2
    logits[0, 10], logits[0, 11] = -0.5, -0.8
    seq = make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[10])
    assert sample(logits, [seq]).token_ids == [11]  # -0.5 * 2 = -1.0 < -0.8


def test_frequency_penalty_scales_with_output_count_and_ignores_prompt() -> None:
    logits = random_logits(1)
    logits[0, 10], logits[0, 11] = 10.0, 9.5
    twice = make_seq(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[10, 3, 10])
    assert sample(logits, [twice]).token_ids == [11]  # 10 - 2 * 0.3 = 9.4 < 9.5
    once = make_seq(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[10])
    assert sample(logits, [once]).token_ids == [10]  # 9.7 > 9.5
    prompt_only = make_seq(SamplingParams(temperature=0.0, frequency_penalty=2.0), prompt=[10, 10, 10])
    assert sample(logits, [prompt_only]).token_ids == [10]


def test_presence_penalty_is_flat_whatever_the_count() -> None:
    logits = random_logits(1)
    logits[0, 10], logits[0, 11] = 10.0, 9.5
    many = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.4), output=[10] * 5)
    assert sample(logits, [many]).token_ids == [10]  # 10 - 0.4 = 9.6 > 9.5, not 10 - 5 * 0.4
    once = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.6), output=[10])
    assert sample(logits, [once]).token_ids == [11]
    prompt_only = make_seq(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[10])
    assert sample(logits, [prompt_only]).token_ids == [10]


def test_greedy_with_penalties_equals_argmax_of_hand_penalised_logits() -> None:
    settings = [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.1), (0.8, -0.5, 0.4), (1.6, 1.2, 0.9)]
    gen = torch.Generator().manual_seed(1)
    logits = random_logits(len(settings), seed=1)
    seqs, expected = [], []
    for i, (rep, freq, pres) in enumerate(settings):
        # Output drawn from the row's own top tokens, so that the penalties change the answer.
        top = logits[i].topk(4).indices
        output = top[torch.randint(0, 4, (6,), generator=gen)].tolist()
        prompt = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                                presence_penalty=pres)
        seqs.append(make_seq(params, prompt=prompt, output=output, seq_id=i))
        expected.append(argmax(hand_penalised(logits[i].tolist(), prompt, output, rep, freq, pres)))
    assert sample(logits, seqs).token_ids == expected
    assert expected != [argmax(row) for row in logits.tolist()]  # the penalties did matter


# ---------------------------------------------------------------- top-k, top-p, min-p, temperature

def test_top_k_one_behaves_like_greedy() -> None:
    logits = random_logits(50, seed=2)
    seqs = [make_seq(SamplingParams(temperature=1.5, top_k=1), seq_id=i) for i in range(50)]
    assert sample(logits, seqs).token_ids == [argmax(row) for row in logits.tolist()]


def test_top_k_never_samples_outside_top_k() -> None:
    torch.manual_seed(0)
    row = random_logits(1, seed=3)[0]
    largest = set(sorted(range(VOCAB), key=lambda i: -row[i].item())[:5])
    tokens = draw_many(row, SamplingParams(temperature=2.0, top_k=5), 3000)
    assert set(tokens) == largest  # only the five largest, and each of them does occur


def test_small_top_p_keeps_only_the_top_token() -> None:
    torch.manual_seed(0)
    row = random_logits(1, seed=4)[0]
    tokens = draw_many(row, SamplingParams(temperature=1.0, top_p=0.01), 500)
    assert set(tokens) == {argmax(row.tolist())}


def test_top_p_keeps_the_smallest_prefix_reaching_top_p() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    position = torch.randperm(4, generator=torch.Generator().manual_seed(5))  # where each prob lands
    row = torch.empty(4)
    row[position] = probs.log() + torch.randn(1, generator=torch.Generator().manual_seed(6))  # shift-invariant
    ids = position.tolist()
    two = draw_many(row, SamplingParams(temperature=1.0, top_p=0.75), 4000)
    assert_matches_distribution(two, _at(ids, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    three = draw_many(row, SamplingParams(temperature=1.0, top_p=0.85), 4000)
    assert_matches_distribution(three, _at(ids, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]))


def _at(ids: list[int], values: list[float]) -> list[float]:
    """values[j] placed at token ids[j]."""
    placed = [0.0] * len(ids)
    for token, value in zip(ids, values):
        placed[token] = value
    return placed


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    torch.manual_seed(0)
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]  # min_p = 0.2: threshold 0.08 keeps the first three
    row = torch.tensor(probs).log() + torch.randn(1, generator=torch.Generator().manual_seed(7))
    tokens = draw_many(row, SamplingParams(temperature=1.0, min_p=0.2), 4000)
    assert_matches_distribution(tokens, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0, 0.0])


def test_unseeded_sampling_matches_softmax_of_logits_over_temperature() -> None:
    torch.manual_seed(0)
    row = random_logits(1, vocab=8, seed=8)[0]
    tokens = draw_many(row, SamplingParams(temperature=0.7), 20000)
    assert_matches_distribution(tokens, reference_probs(row.tolist(), 0.7))


def test_combined_filters_match_the_per_row_reference() -> None:
    torch.manual_seed(0)
    row = random_logits(1, vocab=16, seed=9)[0] * 1.5
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
    expected = reference_probs(row.tolist(), 0.8, top_k=10, top_p=0.9, min_p=0.05)
    assert 1 < sum(p > 0 for p in expected) < 10  # each filter leaves something to check
    assert_matches_distribution(draw_many(row, params, 20000), expected)


def test_rows_with_different_parameters_are_filtered_independently() -> None:
    torch.manual_seed(0)
    logits = random_logits(3, vocab=12, seed=10)
    settings = [dict(temperature=1.0, top_k=3), dict(temperature=0.5, top_p=0.6), dict(temperature=1.3, min_p=0.3)]
    n = 4000
    seqs = [make_seq(SamplingParams(**settings[r % 3]), seq_id=r) for r in range(3 * n)]
    tokens = sample(logits.repeat(n, 1), seqs).token_ids
    for r, kwargs in enumerate(settings):
        expected = reference_probs(logits[r].tolist(), **kwargs)
        assert_matches_distribution(tokens[r::3], expected)


# ---------------------------------------------------------------- seeds

def step_logits(key: int, step: int, vocab: int = 64) -> torch.Tensor:
    """The logits a sequence identified by `key` sees at `step`, whatever batch it is in."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * key + step))


def generate(seqs: list[Sequence], keys: list[int], steps: int) -> list[list[int]]:
    for step in range(steps):
        logits = torch.stack([step_logits(key, step) for key in keys])
        for seq, token in zip(seqs, sample(logits, seqs).token_ids):
            seq.append_token(token)
    return [seq.output_token_ids for seq in seqs]


def test_same_seed_gives_same_tokens_whatever_else_is_in_the_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    torch.manual_seed(1)
    alone = generate([make_seq(params)], [0], 25)[0]

    torch.manual_seed(2)  # the global RNG must not matter either
    others = [make_seq(SamplingParams(temperature=1.0), seq_id=1), make_seq(params, seq_id=2),
              make_seq(SamplingParams(temperature=0.7, top_k=5, seed=99), seq_id=3),
              make_seq(SamplingParams(temperature=0.0), seq_id=4)]
    batched = generate(others, [7, 0, 8, 9], 25)
    assert batched[1] == alone
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens() -> None:
    first = generate([make_seq(SamplingParams(temperature=1.0, seed=1))], [0], 25)[0]
    second = generate([make_seq(SamplingParams(temperature=1.0, seed=2))], [0], 25)[0]
    assert first != second


# ---------------------------------------------------------------- min_tokens

def eos_favoured_logits() -> torch.Tensor:
    logits = random_logits(1, seed=11)
    logits[0, EOS] = logits.max() + 3.0  # EOS is the argmax,
    logits[0, 20] = logits[0, EOS] - 1.0  # stop token 20 the runner-up,
    logits[0, 13] = logits[0, EOS] - 2.0  # and 13 the best ordinary token
    return logits


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20])
    for output in ([], [4]):
        assert sample(eos_favoured_logits(), [make_seq(params, output=output)]).token_ids == [13]


def test_min_tokens_stops_masking_once_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20])
    assert sample(eos_favoured_logits(), [make_seq(params, output=[4, 8])]).token_ids == [EOS]


def test_min_tokens_masks_every_eos_id() -> None:
    logits = eos_favoured_logits()
    logits[0, 30] = logits[0, EOS]  # a second EOS id, tied with the first
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert sample(logits, [make_seq(params)], eos=(EOS, 30)).token_ids == [20]


def test_min_tokens_with_ignore_eos_leaves_eos_alone_but_masks_stop_token_ids() -> None:
    logits = eos_favoured_logits()
    logits[0, 20] = logits[0, EOS] + 1.0  # now the stop token is the argmax and EOS the runner-up
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[20])
    assert sample(logits, [make_seq(params)]).token_ids == [EOS]


def test_min_tokens_never_lets_sampling_draw_eos() -> None:
    torch.manual_seed(0)
    row = eos_favoured_logits()[0]
    tokens = draw_many(row, SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[20]), 2000)
    masked = row.clone()
    masked[[EOS, 20]] = float("-inf")
    assert_matches_distribution(tokens, reference_probs(masked.tolist(), 1.0))


# ---------------------------------------------------------------- logprobs

def raw_logprobs(row: list[float]) -> list[float]:
    top = max(row)
    log_total = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - log_total for v in row]


def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top_k() -> None:
    torch.manual_seed(0)
    logits = random_logits(40, seed=12)
    seqs = [make_seq(SamplingParams(temperature=1.5, logprobs=5), seq_id=i) for i in range(40)]
    out = sample(logits, seqs)
    ranks = set()
    for row, token, info in zip(logits.tolist(), out.token_ids, out.logprobs):
        expected = raw_logprobs(row)
        assert info.token_id == token
        assert info.logprob == pytest.approx(expected[token], abs=1e-5)
        assert info.rank == 1 + sum(v > row[token] for v in row)
        best = sorted(range(VOCAB), key=lambda t: -expected[t])[:5]
        assert [t for t, _ in info.top] == best
        assert [lp for _, lp in info.top] == pytest.approx([expected[t] for t in best], abs=1e-5)
        ranks.add(info.rank)
    assert len(ranks) > 2  # sampled tokens of several ranks were checked


def test_logprobs_describe_the_distribution_before_penalties_and_min_tokens() -> None:
    logits = eos_favoured_logits()
    params = SamplingParams(temperature=0.0, min_tokens=1, repetition_penalty=1.5, logprobs=2)
    info = sample(logits, [make_seq(params, prompt=[EOS, 20])]).logprobs[0]
    expected = raw_logprobs(logits[0].tolist())
    assert info.token_id == 13
    assert info.rank == 3  # behind EOS and 20 in the raw distribution
    assert [t for t, _ in info.top] == [EOS, 20]
    assert info.logprob == pytest.approx(expected[13], abs=1e-5)
    assert info.top[0][1] == pytest.approx(expected[EOS], abs=1e-5)


def test_greedy_token_has_rank_one_and_tied_tokens_share_the_worse_rank() -> None:
    logits = random_logits(2, seed=13)
    logits[1, 4] = logits[1, 17] = logits[1].max() + 1.0
    seqs = [make_seq(SamplingParams(temperature=0.0, logprobs=1), seq_id=i) for i in range(2)]
    out = sample(logits, seqs)
    assert out.logprobs[0].rank == 1
    assert out.token_ids[1] == 4 and out.logprobs[1].rank == 2  # 4 and 17 are both at least as likely


def test_logprobs_zero_gives_an_empty_top_list_and_none_gives_none() -> None:
    logits = random_logits(2, seed=14)
    seqs = [make_seq(SamplingParams(temperature=0.0, logprobs=0), seq_id=0),
            make_seq(SamplingParams(temperature=0.0), seq_id=1)]
    out = sample(logits, seqs)
    assert out.logprobs[0].top == []
    assert out.logprobs[0].logprob == pytest.approx(max(raw_logprobs(logits[0].tolist())), abs=1e-5)
    assert out.logprobs[1] is None


def test_logprobs_larger_than_the_vocabulary_return_the_whole_vocabulary() -> None:
    logits = random_logits(1, vocab=6, seed=15)
    info = sample(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=20), prompt=[1])]).logprobs[0]
    assert sorted(t for t, _ in info.top) == list(range(6))


# ---------------------------------------------------------------- batches

def mixed_seqs() -> list[Sequence]:
    return [
        make_seq(SamplingParams(temperature=0.0), seq_id=0),
        make_seq(SamplingParams(temperature=0.8, top_k=10), seq_id=1),
        make_seq(SamplingParams(temperature=1.0, min_p=0.05, seed=5, logprobs=3), seq_id=2),
        make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=0.3), output=[3, 3, 9], seq_id=3),
        make_seq(SamplingParams(temperature=0.0, min_tokens=4), output=[1], seq_id=4),
    ]


def test_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    logits = random_logits(5, seed=16)
    logits[4, EOS] = logits[4].max() + 1.0  # the min_tokens row would otherwise end here
    # Row 1 is the only unseeded sampled row, so it sees the same global-RNG draw alone and in the batch.
    torch.manual_seed(3)
    batched = sample(logits, mixed_seqs())
    for i, seq in enumerate(mixed_seqs()):
        torch.manual_seed(3)
        alone = sample(logits[i : i + 1], [seq])
        assert alone.token_ids == [batched.token_ids[i]], f"row {i}"
        if alone.logprobs[0] is not None:
            assert batched.logprobs[i].token_id == alone.logprobs[0].token_id
            assert batched.logprobs[i].rank == alone.logprobs[0].rank
            assert batched.logprobs[i].logprob == pytest.approx(alone.logprobs[0].logprob)
        else:
            assert batched.logprobs[i] is None
    assert batched.token_ids[4] != EOS


def test_sampler_leaves_the_callers_logits_unchanged() -> None:
    logits = random_logits(5, seed=17)
    before = logits.clone()
    sample(logits, mixed_seqs())
    assert torch.equal(logits, before)
