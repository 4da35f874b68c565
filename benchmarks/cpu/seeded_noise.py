"""Seeded sampling's noise on the CPU: ``exponential_noise`` (a few rows at a time, the hash's temporaries kept in
the cache) against the whole table at once, as it ran before, at one torch thread: a seeded request (OpenAI's
``seed``) costs a [rows, vocab] splitmix64 table every step, more than the default model's forward for 200 rows.

    python -m benchmarks.cpu.seeded_noise [--rows 1 16 200] [--vocab 49152 262144] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import record
from benchmarks.harness.median_timing import median_ms
from engine.sample.seeded_noise import exponential_noise, splitmix64


def whole_table(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise as computed before: every row at once, through the full splitmix64 output."""
    top = (splitmix64(keys, vocab) >> 41) & ((1 << 23) - 1)
    return ((top * 2 + 1).to(torch.float32) * 2.0**-24).log_().neg_()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 200])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = record.load_average()
    rows_out = []
    for vocab in args.vocab:
        for rows in args.rows:
            keys = torch.randint(
                -(2**62), 2**62, (rows,), generator=torch.Generator().manual_seed(rows)
            )
            assert torch.equal(exponential_noise(keys, vocab), whole_table(keys, vocab))
            rows_out.append(
                {
                    "rows": rows,
                    "vocab": vocab,
                    "whole_table_s": median_ms(lambda: whole_table(keys, vocab), args.repeats)
                    / 1e3,
                    "chunked_s": median_ms(lambda: exponential_noise(keys, vocab), args.repeats)
                    / 1e3,
                }
            )
    env = record.environment(__spec__.name, "cpu", load_before=load_before)
    record.write_json(args.json, {"environment": env, "rows": rows_out})
    print("\n".join([*table(rows_out), record.environment_line(env)]))


def table(rows: list[dict]) -> list[str]:
    header = [
        "| rows | vocab | whole table s | a few rows at a time s | speed-up |",
        "|---:" * 5 + "|",
    ]
    return header + [
        f"| {r['rows']} | {r['vocab']} | {r['whole_table_s']:.4f} | {r['chunked_s']:.4f} "
        f"| {r['whole_table_s'] / r['chunked_s']:.1f}x |"
        for r in rows
    ]


if __name__ == "__main__":
    main()
