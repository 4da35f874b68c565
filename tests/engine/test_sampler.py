"""Sampler specification: greedy, penalties, top-k / top-p / min-p, seeds, min_tokens, logprobs, logit_bias,
the structured-output bitmask, and launching without a host sync.

Expected values come from hand-built logits or from the small per-row references below (plain Python
floats, one row at a time), never from the sampler itself.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sample import logits_processors
from engine.sample.logits_processors import unpack_bitmask
from engine.sample.sampler import Sampler, SamplerOutput
from engine.sample.seeded_noise import draw_key, exponential_noise, splitmix64
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = 2
VOCAB = 32


# ---------------------------------------------------------------- helpers


def make_seq(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seq_id: int = 0,
) -> Sequence:
    prompt = [5, 6, 7] if prompt is None else prompt
    output = [] if output is None else output
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        token_ids=prompt + output,
        params=params,
        num_prompt_tokens=len(prompt),
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos: tuple[int, ...] = (EOS,)
) -> SamplerOutput:
    return Sampler()(logits, seqs, eos)


def draw_many(row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n independent unseeded draws from one row of logits, as one batch of n identical rows."""
    seqs = [make_seq(params, seq_id=i) for i in range(n)]
    return sample(row.expand(n, -1).contiguous(), seqs).token_ids.tolist()


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def reference_probs(
    row: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
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
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 10, (
        f"chi2={chi2:.1f} with {dof} degrees of freedom"
    )


def hand_penalised(
    row: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
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
    assert out.token_ids.tolist() == [argmax(row) for row in logits.tolist()]
    assert out.logprobs() == [None] * 6


def test_greedy_ties_pick_the_lowest_index() -> None:
    logits = random_logits(1)
    logits[0, 9] = logits[0, 21] = logits.max() + 1.0
    assert sample(logits, [make_seq(SamplingParams(temperature=0.0))]).token_ids.tolist() == [9]
    with_logprobs = make_seq(SamplingParams(temperature=0.0, logprobs=1))  # the slower path agrees
    assert sample(logits, [with_logprobs]).token_ids.tolist() == [9]


def test_repetition_penalty_divides_positive_logits_of_seen_tokens() -> None:
    logits = random_logits(1)  # values within about +-3
    logits[0, 10], logits[0, 11] = 10.0, 6.0
    seen_in_prompt = make_seq(
        SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[10, 4]
    )
    assert sample(logits, [seen_in_prompt]).token_ids.tolist() == [11]  # 10 / 2 = 5 < 6
    seen_in_output = make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[10])
    assert sample(logits, [seen_in_output]).token_ids.tolist() == [11]
    mild = make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[10])
    assert sample(logits, [mild]).token_ids.tolist() == [10]  # 10 / 1.5 = 6.67 > 6


def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = -random_logits(1).abs() - 2.0  # every logit <= -2
    logits[0, 10], logits[0, 11] = -0.5, -0.8
    seq = make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[10])
    assert sample(logits, [seq]).token_ids.tolist() == [11]  # -0.5 * 2 = -1.0 < -0.8


def test_frequency_penalty_scales_with_output_count_and_ignores_prompt() -> None:
    logits = random_logits(1)
    logits[0, 10], logits[0, 11] = 10.0, 9.5
    twice = make_seq(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[10, 3, 10])
    assert sample(logits, [twice]).token_ids.tolist() == [11]  # 10 - 2 * 0.3 = 9.4 < 9.5
    once = make_seq(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[10])
    assert sample(logits, [once]).token_ids.tolist() == [10]  # 9.7 > 9.5
    prompt_only = make_seq(
        SamplingParams(temperature=0.0, frequency_penalty=2.0), prompt=[10, 10, 10]
    )
    assert sample(logits, [prompt_only]).token_ids.tolist() == [10]


def test_presence_penalty_is_flat_whatever_the_count() -> None:
    logits = random_logits(1)
    logits[0, 10], logits[0, 11] = 10.0, 9.5
    many = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.4), output=[10] * 5)
    # 10 - 0.4 = 9.6 > 9.5, not 10 - 5 * 0.4
    assert sample(logits, [many]).token_ids.tolist() == [10]
    once = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.6), output=[10])
    assert sample(logits, [once]).token_ids.tolist() == [11]
    prompt_only = make_seq(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[10])
    assert sample(logits, [prompt_only]).token_ids.tolist() == [10]


def test_greedy_with_penalties_equals_argmax_of_hand_penalised_logits() -> None:
    settings = [
        (1.3, 0.0, 0.0),
        (1.0, 0.7, 0.0),
        (1.0, 0.0, 1.1),
        (0.8, -0.5, 0.4),
        (1.6, 1.2, 0.9),
    ]
    gen = torch.Generator().manual_seed(1)
    logits = random_logits(len(settings), seed=1)
    seqs, expected = [], []
    for i, (rep, freq, pres) in enumerate(settings):
        # Output drawn from the row's own top tokens, so that the penalties change the answer.
        top = logits[i].topk(4).indices
        output = top[torch.randint(0, 4, (6,), generator=gen)].tolist()
        prompt = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        params = SamplingParams(
            temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
        )
        seqs.append(make_seq(params, prompt=prompt, output=output, seq_id=i))
        expected.append(argmax(hand_penalised(logits[i].tolist(), prompt, output, rep, freq, pres)))
    assert sample(logits, seqs).token_ids.tolist() == expected
    assert expected != [argmax(row) for row in logits.tolist()]  # the penalties did matter


# ---------------------------------------------------------------- top-k, top-p, min-p, temperature


def test_top_k_one_behaves_like_greedy() -> None:
    logits = random_logits(50, seed=2)
    seqs = [make_seq(SamplingParams(temperature=1.5, top_k=1), seq_id=i) for i in range(50)]
    assert sample(logits, seqs).token_ids.tolist() == [argmax(row) for row in logits.tolist()]


def test_top_k_never_samples_outside_top_k() -> None:
    torch.manual_seed(0)
    row = random_logits(1, seed=3)[0]
    largest = set(sorted(range(VOCAB), key=lambda i: -row[i].item())[:5])
    tokens = draw_many(row, SamplingParams(temperature=2.0, top_k=5), 3000)
    assert set(tokens) == largest  # only the five largest, and each of them does occur


# 5e-324 rounds to 0 in float32: the top token still stays
@pytest.mark.parametrize("top_p", [0.01, 5e-324])
def test_small_top_p_keeps_only_the_top_token(top_p: float) -> None:
    torch.manual_seed(0)
    row = random_logits(1, seed=4)[0]
    tokens = draw_many(row, SamplingParams(temperature=1.0, top_p=top_p), 500)
    assert set(tokens) == {argmax(row.tolist())}


def test_top_p_keeps_the_smallest_prefix_reaching_top_p() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # where each prob lands
    position = torch.randperm(4, generator=torch.Generator().manual_seed(5))
    row = torch.empty(4)
    # shift-invariant
    row[position] = probs.log() + torch.randn(1, generator=torch.Generator().manual_seed(6))
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
    settings = [
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.5, top_p=0.6),
        dict(temperature=1.3, min_p=0.3),
    ]
    n = 4000
    seqs = [make_seq(SamplingParams(**settings[r % 3]), seq_id=r) for r in range(3 * n)]
    tokens = sample(logits.repeat(n, 1), seqs).token_ids.tolist()
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
        for seq, token in zip(seqs, sample(logits, seqs).token_ids.tolist()):
            seq.append_token(token)
    return [seq.output_token_ids for seq in seqs]


def test_same_seed_gives_same_tokens_whatever_else_is_in_the_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    torch.manual_seed(1)
    alone = generate([make_seq(params)], [0], 25)[0]

    torch.manual_seed(2)  # the global RNG must not matter either
    others = [
        make_seq(SamplingParams(temperature=1.0), seq_id=1),
        make_seq(params, seq_id=2),
        make_seq(SamplingParams(temperature=0.7, top_k=5, seed=99), seq_id=3),
        make_seq(SamplingParams(temperature=0.0), seq_id=4),
    ]
    batched = generate(others, [7, 0, 8, 9], 25)
    assert batched[1] == alone
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens() -> None:
    first = generate([make_seq(SamplingParams(temperature=1.0, seed=1))], [0], 25)[0]
    second = generate([make_seq(SamplingParams(temperature=1.0, seed=2))], [0], 25)[0]
    assert first != second


def reference_splitmix64(state: int, count: int) -> list[int]:
    """Vigna's splitmix64 on Python ints modulo 2^64: state += golden, then the finaliser."""
    mask, outputs = 2**64 - 1, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        outputs.append(z ^ (z >> 31))
    return outputs


def test_seeded_noise_generator_is_splitmix64_bit_for_bit() -> None:
    # The widely quoted first outputs of splitmix64 from state 1234567.
    quoted = [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    assert reference_splitmix64(1234567, 5) == quoted
    keys = [1234567, -5, 2**62 + 3, -(2**63)]
    table = splitmix64(torch.tensor(keys), 200).tolist()
    for key, row in zip(keys, table):
        assert [value % 2**64 for value in row] == reference_splitmix64(key % 2**64, 200)


def test_seeded_noise_in_row_chunks_is_the_whole_tables_noise() -> None:
    """On the CPU the noise is hashed a few rows at a time, without the finaliser's last xor-shift (it leaves the
    top 23 bits alone): bit for bit -log((2m + 1) / 2^24) of the full splitmix64 table's top bits m, whatever
    the chunk (vocabularies of 7, 1,000 and 70,000: 18,724, 131 and 1 rows a chunk; 37 rows)."""
    keys = torch.tensor(
        [draw_key(seed, position) for seed in range(37) for position in (0, 9)][:37]
    )
    for vocab in (7, 1000, 70_000):
        top = (splitmix64(keys, vocab) >> 41) & ((1 << 23) - 1)
        expected = ((top * 2 + 1).to(torch.float32) * 2.0**-24).log().neg()
        assert torch.equal(exponential_noise(keys, vocab), expected)


def test_seeded_noise_is_exponential_with_mean_and_variance_one() -> None:
    keys = torch.tensor([draw_key(seed, position) for seed in range(250) for position in range(4)])
    noise = exponential_noise(keys, 100).flatten().double()  # 100,000 values
    n = noise.numel()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1) < 0.02  # the mean's standard error is 0.003
    assert abs(noise.var().item() - 1) < 0.05
    # Ten bins of equal Exp(1) probability: edges at -log(1 - j / 10).
    edges = torch.tensor([-math.log(1 - j / 10) for j in range(1, 10)], dtype=torch.float64)
    counts = torch.bucketize(noise, edges).bincount(minlength=10).tolist()
    chi2 = sum((c - n / 10) ** 2 / (n / 10) for c in counts)
    assert chi2 < 9 + 8 * math.sqrt(18) + 10, f"chi2={chi2:.1f} over 9 degrees of freedom"


def test_seeded_draws_follow_the_distribution_across_seeds_and_positions() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 3000
    rows = torch.tensor(probs).log().expand(n, -1).contiguous()
    across_seeds = [make_seq(SamplingParams(temperature=1.0, seed=s), seq_id=s) for s in range(n)]
    assert_matches_distribution(sample(rows, across_seeds).token_ids.tolist(), probs)
    one_seed = [
        make_seq(SamplingParams(temperature=1.0, seed=77), output=[9] * p, seq_id=p)
        for p in range(n)
    ]
    assert_matches_distribution(sample(rows, one_seed).token_ids.tolist(), probs)


def test_a_seeded_draw_repeats_for_the_same_seed_and_position_only() -> None:
    row = random_logits(1, vocab=64, seed=20)

    def draw(seed: int, position: int) -> int:
        seq = make_seq(SamplingParams(temperature=1.0, seed=seed), output=[3] * position)
        return sample(row, [seq]).token_ids.tolist()[0]

    for seed, position in [(0, 0), (1, 5), (2**64 - 1, 3), (-(2**63), 0)]:
        torch.manual_seed(seed % 1000)
        first = draw(seed, position)
        torch.manual_seed(seed % 1000 + 1)  # the global RNG plays no part
        assert draw(seed, position) == first
    assert len({draw(seed, 0) for seed in range(40)}) > 10
    assert len({draw(7, position) for position in range(40)}) > 10
    noise = exponential_noise(
        torch.tensor([draw_key(5, 0), draw_key(5, 0), draw_key(6, 0), draw_key(5, 1)]), 64
    )
    assert torch.equal(noise[0], noise[1])
    assert (noise[0] != noise[2]).all() and (noise[0] != noise[3]).all()


def test_a_seeded_row_draws_the_same_token_in_any_batch() -> None:
    n, vocab = 30, 64
    logits = random_logits(n, vocab=vocab, seed=21)
    targets = [
        make_seq(
            SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i),
            output=[1] * i,
            seq_id=i,
        )
        for i in range(n)
    ]
    torch.manual_seed(4)
    alone = [
        sample(logits[i : i + 1], [seq]).token_ids.tolist()[0] for i, seq in enumerate(targets)
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.4),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.2, min_p=0.1, logprobs=2),
    ]
    batch_logits, batch, target_rows = [], [], []
    for i, seq in enumerate(targets):  # each target after a different number and mix of other rows
        for j in range(i % 4):
            batch.append(make_seq(others[(i + j) % len(others)], seq_id=1000 + len(batch)))
            batch_logits.append(random_logits(1, vocab=vocab, seed=500 + len(batch))[0])
        target_rows.append(len(batch))
        batch.append(seq)
        batch_logits.append(logits[i])
    torch.manual_seed(5)
    batched = sample(torch.stack(batch_logits), batch).token_ids.tolist()
    assert [batched[r] for r in target_rows] == alone
    assert len(set(alone)) > 5


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
        assert sample(
            eos_favoured_logits(), [make_seq(params, output=output)]
        ).token_ids.tolist() == [13]


def test_min_tokens_stops_masking_once_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20])
    assert sample(eos_favoured_logits(), [make_seq(params, output=[4, 8])]).token_ids.tolist() == [
        EOS
    ]


def test_min_tokens_gives_way_where_only_the_banned_ids_are_allowed() -> None:
    """Structured output whose grammar allows only EOS: the row samples EOS (min_tokens cannot be met), while a
    row of the same batch with other tokens allowed still has EOS masked."""
    params = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[20])
    logits = torch.cat([eos_favoured_logits(), eos_favoured_logits()])
    # bit t: token t may be sampled (VOCAB = 32: one word)
    allowed = torch.zeros(2, 1, dtype=torch.int32)
    allowed[0, 0] = 1 << EOS  # row 0: only EOS
    allowed[1, 0] = (1 << EOS) | (1 << 13) | (1 << 20)  # row 1: EOS, 13 and the stop token 20
    out = Sampler()(
        logits, [make_seq(params, seq_id=0), make_seq(params, seq_id=1)], (EOS,), allowed
    )
    assert out.token_ids.tolist() == [EOS, 13]


def test_min_tokens_masks_every_eos_id() -> None:
    logits = eos_favoured_logits()
    logits[0, 30] = logits[0, EOS]  # a second EOS id, tied with the first
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert sample(logits, [make_seq(params)], eos=(EOS, 30)).token_ids.tolist() == [20]


def test_min_tokens_with_ignore_eos_leaves_eos_alone_but_masks_stop_token_ids() -> None:
    logits = eos_favoured_logits()
    logits[0, 20] = logits[0, EOS] + 1.0  # now the stop token is the argmax and EOS the runner-up
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[20])
    assert sample(logits, [make_seq(params)]).token_ids.tolist() == [EOS]


def test_min_tokens_never_lets_sampling_draw_eos() -> None:
    torch.manual_seed(0)
    row = eos_favoured_logits()[0]
    tokens = draw_many(
        row, SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[20]), 2000
    )
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
    for row, token, info in zip(logits.tolist(), out.token_ids.tolist(), out.logprobs()):
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
    info = sample(logits, [make_seq(params, prompt=[EOS, 20])]).logprobs()[0]
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
    first, second = out.logprobs()
    assert first.rank == 1
    # 4 and 17 are both at least as likely
    assert out.token_ids.tolist()[1] == 4 and second.rank == 2


def test_logprobs_zero_gives_an_empty_top_list_and_none_gives_none() -> None:
    logits = random_logits(2, seed=14)
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=0), seq_id=0),
        make_seq(SamplingParams(temperature=0.0), seq_id=1),
    ]
    zero, none = sample(logits, seqs).logprobs()
    assert zero.top == []
    assert zero.logprob == pytest.approx(max(raw_logprobs(logits[0].tolist())), abs=1e-5)
    assert none is None


def test_logprobs_larger_than_the_vocabulary_return_the_whole_vocabulary() -> None:
    logits = random_logits(1, vocab=6, seed=15)
    info = sample(
        logits, [make_seq(SamplingParams(temperature=0.0, logprobs=20), prompt=[1])]
    ).logprobs()[0]
    assert sorted(t for t, _ in info.top) == list(range(6))


# ---------------------------------------------------------------- batches


def mixed_seqs() -> list[Sequence]:
    return [
        make_seq(SamplingParams(temperature=0.0), seq_id=0),
        make_seq(SamplingParams(temperature=0.8, top_k=10), seq_id=1),
        make_seq(SamplingParams(temperature=1.0, min_p=0.05, seed=5, logprobs=3), seq_id=2),
        make_seq(
            SamplingParams(
                temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3
            ),
            output=[3, 3, 9],
            seq_id=3,
        ),
        make_seq(SamplingParams(temperature=0.0, min_tokens=4), output=[1], seq_id=4),
    ]


def test_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    logits = random_logits(5, seed=16)
    logits[4, EOS] = logits[4].max() + 1.0  # the min_tokens row would otherwise end here
    # Row 1 is the only unseeded sampled row, so it sees the same global-RNG draw alone and in the batch.
    torch.manual_seed(3)
    batched = sample(logits, mixed_seqs())
    batched_ids, batched_logprobs = batched.token_ids.tolist(), batched.logprobs()
    for i, seq in enumerate(mixed_seqs()):
        torch.manual_seed(3)
        alone = sample(logits[i : i + 1], [seq])
        assert alone.token_ids.tolist() == [batched_ids[i]], f"row {i}"
        [info] = alone.logprobs()
        if info is not None:
            assert batched_logprobs[i].token_id == info.token_id
            assert batched_logprobs[i].rank == info.rank
            assert batched_logprobs[i].logprob == pytest.approx(info.logprob)
        else:
            assert batched_logprobs[i] is None
    assert batched_ids[4] != EOS


def test_sampler_leaves_the_callers_logits_unchanged() -> None:
    logits = random_logits(5, seed=17)
    before = logits.clone()
    sample(logits, mixed_seqs())
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- no host sync, dtypes


def forbid(monkeypatch: pytest.MonkeyPatch, owner: object, names: tuple[str, ...]) -> None:
    for name in names:

        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} called inside the sampler")

        monkeypatch.setattr(owner, name, refuse)


def forbid_host_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a tensor's values reach the host, and the data-dependent shapes that need them."""
    forbid(
        monkeypatch,
        torch.Tensor,
        (
            "tolist",
            "item",
            "cpu",
            "numpy",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "masked_select",
        ),
    )
    forbid(monkeypatch, torch, ("nonzero", "masked_select", "multinomial"))
    for name in ("__getitem__", "__setitem__"):
        original = getattr(torch.Tensor, name)

        def no_boolean_mask(self, index, *args, _original=original):
            parts = index if isinstance(index, tuple) else (index,)
            assert not any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts), (
                "boolean mask"
            )
            return _original(self, index, *args)

        monkeypatch.setattr(torch.Tensor, name, no_boolean_mask)


def sync_test_batch() -> list[Sequence]:
    return mixed_seqs() + [
        make_seq(SamplingParams(temperature=0.9, top_p=0.8, seed=11), output=[4, 4], seq_id=5),
        make_seq(
            SamplingParams(temperature=1.1, top_k=6, top_p=0.9, min_p=0.02, logprobs=2), seq_id=6
        ),
        make_seq(
            SamplingParams(temperature=0.7, presence_penalty=0.5, seed=12, logit_bias={3: 2.0}),
            seq_id=7,
        ),
        make_seq(
            SamplingParams(temperature=0.0, logprobs=0, min_tokens=3, stop_token_ids=[20]), seq_id=8
        ),
    ]


def test_sampling_launches_without_reading_anything_back(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = random_logits(9, seed=18)
    seqs = sync_test_batch()
    # the device's paths (CUDA's) on CPU tensors, which would otherwise take the host's (which read freely)
    monkeypatch.setattr(logits_processors, "decides_on_host", lambda tensor: False)
    forbid_host_syncs(monkeypatch)
    out = sample(logits, seqs)
    monkeypatch.undo()
    token_ids, logprobs = out.token_ids.tolist(), out.logprobs()  # reading the results may wait
    assert [info is None for info in logprobs] == [seq.params.logprobs is None for seq in seqs]
    assert all(info.token_id == token_ids[i] for i, info in enumerate(logprobs) if info is not None)
    assert token_ids[0] == argmax(logits[0].tolist())


def test_greedy_fast_path_is_one_argmax_on_the_logits_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = random_logits(6, seed=19).to(torch.bfloat16)
    expected = [argmax(row) for row in logits.float().tolist()]
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(6)]
    forbid_host_syncs(monkeypatch)
    forbid(
        monkeypatch, torch.Tensor, ("float", "to", "clone", "contiguous", "__truediv__", "softmax")
    )
    out = sample(logits, seqs)
    monkeypatch.undo()
    assert out.token_ids.dtype == torch.int64 and out.token_ids.tolist() == expected
    assert out.logprobs() == [None] * 6


def test_bfloat16_logits_are_processed_in_float32() -> None:
    logits = random_logits(9, seed=22).to(torch.bfloat16)
    torch.manual_seed(6)
    from_bf16 = sample(logits, sync_test_batch())
    torch.manual_seed(6)
    from_f32 = sample(logits.float(), sync_test_batch())  # the same values, exactly
    assert from_bf16.token_ids.tolist() == from_f32.token_ids.tolist()
    assert from_bf16.logprobs() == from_f32.logprobs()


# ---------------------------------------------------------------- logit_bias, structured output


def test_logit_bias_moves_the_choice_but_not_the_logprobs() -> None:
    logits = random_logits(1, seed=23)  # values within about +-3
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    params = SamplingParams(temperature=0.0, logit_bias={11: 1.5, 10: -0.2}, logprobs=1)
    out = sample(logits, [make_seq(params)])
    assert out.token_ids.tolist() == [11]  # 4 + 1.5 > 5 - 0.2
    [info] = out.logprobs()
    assert info.rank == 2 and info.top[0][0] == 10
    assert info.logprob == pytest.approx(raw_logprobs(logits[0].tolist())[11], abs=1e-5)


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    torch.manual_seed(0)
    row = random_logits(1, vocab=8, seed=24)[0]
    bias = {argmax(row.tolist()): -100.0, 3: 1.0}
    biased = row.tolist()
    for token, value in bias.items():
        biased[token] += value
    tokens = draw_many(row, SamplingParams(temperature=0.8, logit_bias=bias), 20000)
    assert_matches_distribution(tokens, reference_probs(biased, 0.8))


def allowed_bitmask(allowed: list[set[int] | None], vocab: int) -> torch.Tensor:
    """llguidance's layout, built by hand: bit t % 32 of int32 word t // 32 set = token t allowed."""
    words = -(-vocab // 32)
    rows = []
    for tokens in allowed:
        tokens = set(range(words * 32)) if tokens is None else tokens
        unsigned = [sum(1 << (t % 32) for t in tokens if t // 32 == w) for w in range(words)]
        rows.append([u - 2**32 if u >= 2**31 else u for u in unsigned])
    return torch.tensor(rows, dtype=torch.int32)


def test_bitmask_unpacks_to_each_tokens_bit() -> None:
    """Random words (sign bits included) against the definition, bit by bit; a vocabulary that ends mid-word."""
    generator = torch.Generator().manual_seed(3)
    vocab = 5 * 32 + 7
    mask = torch.randint(-(2**31), 2**31, (4, 6), dtype=torch.int32, generator=generator)
    words = mask.tolist()
    expected = [[(row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in words]
    assert unpack_bitmask(mask, vocab).tolist() == expected
    strided = mask.t().contiguous().t()  # (the same words in column-major memory)
    assert unpack_bitmask(strided, vocab).tolist() == expected


def test_allowed_token_bitmask_limits_each_row_to_its_tokens() -> None:
    vocab = 40  # two words, the second partly used; token 31 is the sign bit of word 0
    logits = random_logits(3, vocab=vocab, seed=25)
    allowed = [{3, 31, 39}, None, {0, 31, 32}]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    seqs = [make_seq(p, seq_id=i) for i, p in enumerate(params)]
    out = Sampler()(logits, seqs, (EOS,), allowed_bitmask(allowed, vocab))
    rows = logits.tolist()
    expected = [
        max(sorted(tokens or range(vocab)), key=lambda t: rows[i][t])
        for i, tokens in enumerate(allowed)
    ]
    assert out.token_ids.tolist() == expected
    assert out.logprobs()[2].rank == 1  # logprobs are taken after the grammar's mask

    torch.manual_seed(0)
    n = 6000
    sampled = [make_seq(SamplingParams(temperature=1.0), seq_id=i) for i in range(n)]
    mask = allowed_bitmask([{0, 31, 32, 39}], vocab).expand(n, -1)
    tokens = Sampler()(
        logits[2:3].expand(n, -1).contiguous(), sampled, (EOS,), mask
    ).token_ids.tolist()
    masked = [v if t in {0, 31, 32, 39} else float("-inf") for t, v in enumerate(rows[2])]
    assert_matches_distribution(tokens, reference_probs(masked, 1.0))
