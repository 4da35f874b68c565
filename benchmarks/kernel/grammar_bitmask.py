"""Structured output's bitmask unpacked into a [rows, vocab] bool mask (engine/sample/logits_processors.py's
``unpack_bitmask``, a step of every grammar-constrained batch): a byte at a time through a [256, 8] table, against
each int32 word shifted 32 ways, as it ran before. On the CPU at one torch thread (perf_counter) or on CUDA (CUDA
events); medians.

    python -m benchmarks.kernel.grammar_bitmask [--device cpu|cuda] [--rows 1 64 256] [--vocab 49152 151936]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import record
from benchmarks.harness.median_timing import median_ms
from engine.sample.logits_processors import unpack_bitmask


def shifted_words(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The mask as unpacked before: every word shifted by 0..31, one int32 per token, then bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    load_before = record.load_average()
    rows_out = []
    for vocab in args.vocab:
        for rows in args.rows:
            generator = torch.Generator().manual_seed(rows)
            words = -(-vocab // 32)
            mask = torch.randint(
                -(2**31), 2**31, (rows, words), dtype=torch.int32, generator=generator
            )
            mask = mask.to(device)
            assert torch.equal(unpack_bitmask(mask, vocab), shifted_words(mask, vocab))
            rows_out.append(
                {
                    "rows": rows,
                    "vocab": vocab,
                    "shifted_ms": median_ms(
                        lambda: shifted_words(mask, vocab), args.repeats, device, warm_up=3
                    ),
                    "table_ms": median_ms(
                        lambda: unpack_bitmask(mask, vocab), args.repeats, device, warm_up=3
                    ),
                }
            )
    env = record.environment(__spec__.name, device, load_before=load_before)
    record.write_json(args.json, {"environment": env, "rows": rows_out})
    print("\n".join([*table(rows_out), record.environment_line(env)]))


def table(rows: list[dict]) -> list[str]:
    header = ["| rows | vocab | shifted words ms | byte table ms | speed-up |", "|---:" * 5 + "|"]
    return header + [
        f"| {r['rows']} | {r['vocab']} | {r['shifted_ms']:.3f} | {r['table_ms']:.3f} "
        f"| {r['shifted_ms'] / r['table_ms']:.1f}x |"
        for r in rows
    ]


if __name__ == "__main__":
    main()
