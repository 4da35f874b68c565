"""The sampler on CUDA: seeded draws as on the CPU, the bf16 greedy fast path at real size, no host sync."""

from __future__ import annotations

import pytest
import torch

from engine.sample.sampler import Sampler
from engine.sample.seeded_noise import draw_key, exponential_noise, splitmix64
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

EOS = 2


def make_seq(params: SamplingParams, output: list[int] | None = None, seq_id: int = 0) -> Sequence:
    prompt = [0, 1, 3]
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        token_ids=prompt + (output or []),
        params=params,
        num_prompt_tokens=len(prompt),
    )


def test_seeded_noise_is_the_same_on_cuda_and_cpu() -> None:
    keys = torch.tensor(
        [draw_key(seed, position) for seed in (0, 1, 12345, 2**64 - 1) for position in (0, 7)]
    )
    # integers: bit for bit
    assert torch.equal(splitmix64(keys.cuda(), 128256).cpu(), splitmix64(keys, 128256))
    torch.testing.assert_close(
        exponential_noise(keys.cuda(), 4096).cpu(), exponential_noise(keys, 4096), rtol=1e-6, atol=0
    )


def test_seeded_draws_are_the_same_on_cuda_and_cpu() -> None:
    # Well-separated probabilities, so that no filter boundary sits within rounding of a token.
    row = torch.tensor([0.04, 0.08, 0.12, 0.16, 0.25, 0.35]).log()
    settings = [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 4},
        {"temperature": 1.2, "top_p": 0.7},
        {"temperature": 1.0, "min_p": 0.3},
        {"temperature": 0.9, "frequency_penalty": 0.4},
    ]
    seqs = [
        make_seq(
            SamplingParams(seed=seed, **settings[seed % len(settings)]),
            output=[5] * (seed % 7),
            seq_id=seed,
        )
        for seed in range(400)
    ]
    logits = row.expand(len(seqs), -1).contiguous()
    on_cpu = Sampler()(logits, seqs, (EOS,)).token_ids.tolist()
    on_cuda = Sampler()(logits.cuda(), seqs, (EOS,)).token_ids.tolist()
    assert on_cuda == on_cpu
    assert len(set(on_cpu)) == 6  # really sampled


def test_bf16_greedy_fast_path_is_the_float_argmax_without_a_float_copy() -> None:
    rows, vocab = 256, 128256
    logits = torch.randn(
        rows, vocab, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
    )
    logits = logits.to(torch.bfloat16)
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(rows)]
    Sampler()(logits, seqs, (EOS,))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = Sampler()(logits, seqs, (EOS,))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # bf16 -> float is exact; first of ties
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert extra < rows * vocab * 4 // 16, (
        f"{extra} bytes: a float32 copy of the logits is {rows * vocab * 4}"
    )


def test_mixed_batch_is_sampled_without_a_host_sync() -> None:
    vocab = 1000
    logits = torch.randn(
        9, vocab, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)
    )
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=10),
        SamplingParams(temperature=1.0, seed=5, logprobs=3),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3
        ),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[20]),
        SamplingParams(temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(temperature=1.1, top_k=6, top_p=0.9, min_p=0.02, logprobs=2),
        SamplingParams(temperature=0.7, presence_penalty=0.5, seed=12, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    seqs = [make_seq(p, output=[3, 3, 9], seq_id=i) for i, p in enumerate(params)]
    allowed = torch.full((9, -(-vocab // 32)), -1, dtype=torch.int32)
    allowed[1, :2] = 0  # row 1 may not produce tokens 0-63
    allowed = allowed.pin_memory().to("cuda", non_blocking=True)
    Sampler()(logits, seqs, (EOS,), allowed)  # warm-up: first-use set-up may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, seqs, (EOS,), allowed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    token_ids, logprobs = out.token_ids.tolist(), out.logprobs()
    assert [info is None for info in logprobs] == [seq.params.logprobs is None for seq in seqs]
    assert all(info.token_id == token_ids[i] for i, info in enumerate(logprobs) if info is not None)
    assert token_ids[0] == logits[0].argmax().item() and token_ids[1] >= 64
