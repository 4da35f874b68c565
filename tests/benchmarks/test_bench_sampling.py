"""benchmarks.cpu.sampling: its language-like logits have the short top-p prefixes it claims, its "before" is the
sampler with the whole-row sort and the race's noise (and is undone after), and its report has every case."""

from __future__ import annotations

import json

import torch

from benchmarks.cpu import sampling
from engine.sample import logits_processors, sampler


def prefix_lengths(
    logits: torch.Tensor, temperature: float = 0.7, top_p: float = 0.9
) -> torch.Tensor:
    mass = (
        (logits / temperature).softmax(dim=-1).sort(dim=-1, descending=True).values.cumsum(dim=-1)
    )
    return (mass < top_p).sum(dim=-1) + 1


def test_zipf_rows_have_short_prefixes_and_flat_rows_long_ones() -> None:
    zipf = prefix_lengths(sampling.make_logits("zipf", 256, sampling.VOCAB))
    flat = prefix_lengths(sampling.make_logits("flat", 16, sampling.VOCAB))
    assert zipf.median() <= 8 and (zipf > 64).float().mean() < 0.1 and zipf.max() < 1024
    assert flat.min() > 1024


def test_the_formulas_before_are_the_device_paths_and_are_undone() -> None:
    kept = logits_processors.CPU_CANDIDATES, sampler.draw_on_cpu
    with sampling.formulas_before():
        assert logits_processors.CPU_CANDIDATES == ()
        assert sampler.draw_on_cpu is not kept[1]
    assert (logits_processors.CPU_CANDIDATES, sampler.draw_on_cpu) == kept


def test_the_report_has_every_case(tmp_path, capsys) -> None:
    out = tmp_path / "sampling.json"
    threads = str(torch.get_num_threads())  # (the worker's own)
    sampling.main(
        [
            "--rows",
            "1",
            "2",
            "--logits",
            "zipf",
            "--repeats",
            "1",
            "--threads",
            threads,
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["setting"], r["rows"]) for r in rows] == [
        (setting, n) for setting in sampling.SETTINGS for n in (1, 2)
    ]
    assert all(r["now_ms"] > 0 and r["before_ms"] > 0 for r in rows)
    assert capsys.readouterr().out.count("x |") == len(rows)
