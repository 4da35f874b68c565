"""Sampling on the CPU: the sampler's draw for rows with a temperature, top-p or top-k, as it runs now (top-k / top-p
from each row's largest logits, unseeded rows drawn through their cumulative distribution) against the formulas
before (every row sorted whole, every unseeded row a vocabulary of Exp(1) draws), and the default model's decode
with such requests either way.

Logits: ``zipf`` rows, a random permutation of ``-a * ln(rank)`` with ``a`` uniform in [1.0, 2.2] per row, whose
top-p 0.9 prefixes at temperature 0.7 (median 4 tokens, 2.7% longer than 64, none longer than 1,024) resemble
the default model's own while it answers chat prompts (128 sampled steps: median 2, 3% longer than 64, longest
144); ``flat`` rows, ``randn * 2`` (prefixes of thousands of tokens: every row sorted whole, the worst case).

    python -m benchmarks.cpu.sampling [--rows 1 16 64] [--threads 2] [--engine] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch

from benchmarks.harness import record
from benchmarks.harness.median_timing import median_ms
from engine.sample import logits_processors, sampler
from engine.sample.sampler import Sampler, race_noise
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

VOCAB = 49152  # the default model's
SETTINGS = {
    "T 0.7": dict(temperature=0.7),
    "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "T 1, top-k 40": dict(temperature=1.0, top_k=40),
    "T 0.7, top-p 0.9, seed": dict(temperature=0.7, top_p=0.9, seed=7),
}


@contextlib.contextmanager
def formulas_before() -> Iterator[None]:
    """The sampler with every row sorted whole and the race's Exp(1) noise for unseeded rows."""
    saved = logits_processors.CPU_CANDIDATES, sampler.draw_on_cpu
    logits_processors.CPU_CANDIDATES = ()
    sampler.draw_on_cpu = lambda probs, batch: (probs / race_noise(probs, batch)).argmax(dim=-1)
    try:
        yield
    finally:
        logits_processors.CPU_CANDIDATES, sampler.draw_on_cpu = saved


def make_logits(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(rows, vocab, generator=generator) * 2
    slope = torch.empty(rows, 1).uniform_(1.0, 2.2, generator=generator)
    ranks = torch.argsort(torch.rand(rows, vocab, generator=generator), dim=-1) + 1
    return -slope * ranks.to(torch.float32).log()


def sequences(rows: int, params: dict) -> list[Sequence]:
    seqs = []
    for i in range(rows):
        seq = Sequence(i, str(i), list(range(300)), SamplingParams(max_tokens=100, **params))
        seq.num_prompt_tokens = 300
        seqs.append(seq)
    return seqs


def time_sampler(rows: int, setting: str, kind: str, repeats: int) -> dict:
    logits, seqs, sample = (
        make_logits(kind, rows, VOCAB),
        sequences(rows, SETTINGS[setting]),
        Sampler(),
    )
    row = dict(rows=rows, setting=setting, logits=kind)
    for name, context in (("now", contextlib.nullcontext), ("before", formulas_before)):
        with context():
            row[f"{name}_ms"] = median_ms(lambda: sample(logits, seqs, (0,)), repeats, warm_up=1)
    return row


def time_engine(streams: int, new_tokens: int, repeats: int) -> dict:
    """The default model's decode, ``streams`` requests of ``new_tokens`` at T 0.7 / top-p 0.9 (EOS ignored),
    now and before, alternated; output tokens per second, best of ``repeats``."""
    from engine.llm import LLM

    llm = LLM()
    prompts = [
        llm.chat_prompt_ids([{"role": "user", "content": f"Tell me a story about the number {i}."}])
        for i in range(streams)
    ]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {"now": [], "before": []}
    for attempt in range(repeats + 1):
        for name, context in (("now", contextlib.nullcontext), ("before", formulas_before)):
            with context():
                start = time.perf_counter()
                llm.generate(prompts, params, cache_salt=f"sampling-{attempt}-{name}")
                seconds = time.perf_counter() - start
            if attempt:  # the first round warms up
                runs[name].append(streams * new_tokens / seconds)
    return dict(
        streams=streams, new_tokens=new_tokens, **{f"{k}_tok_s": max(v) for k, v in runs.items()}
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--logits", nargs="+", choices=["zipf", "flat"], default=["zipf", "flat"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--engine", action="store_true", help="also the default model's decode")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    rows = [
        time_sampler(r, s, k, args.repeats)
        for k in args.logits
        for s in SETTINGS
        for r in args.rows
    ]
    print("| logits | setting | rows | now ms | before ms | before / now |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['logits']} | {r['setting']} | {r['rows']} | {r['now_ms']:.2f} | {r['before_ms']:.2f} | "
            f"{r['before_ms'] / r['now_ms']:.1f}x |"
        )
    engine = time_engine(args.streams, args.new_tokens, 2) if args.engine else None
    if engine:
        print(
            f"\nthe default model, {engine['streams']} streams x {engine['new_tokens']} tokens at T 0.7, top-p 0.9:"
            f" {engine['now_tok_s']:.1f} tok/s now, {engine['before_tok_s']:.1f} before"
        )
    env = record.environment(__spec__.name, "cpu", load_before, argv)
    print(record.environment_line(env))
    record.write_json(args.json, dict(environment=env, rows=rows, engine=engine))


if __name__ == "__main__":
    main()
