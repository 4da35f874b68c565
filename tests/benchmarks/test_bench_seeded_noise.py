"""benchmarks.cpu.seeded_noise: the way it times is checked against the way it ran before (the script asserts
the two tables equal), and its report holds one row per shape."""

from __future__ import annotations

import json

import torch

from benchmarks.cpu.seeded_noise import main, whole_table
from engine.sample.seeded_noise import exponential_noise


def test_the_whole_table_is_the_engines_noise_and_the_report_has_every_shape(tmp_path, capsys):
    keys = torch.tensor([3, -(2**63), 2**62 + 11])
    assert torch.equal(whole_table(keys, 70_000), exponential_noise(keys, 70_000))
    out = tmp_path / "seeded.json"
    main(["--rows", "1", "3", "--vocab", "50", "70000", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["vocab"]) for r in rows] == [(1, 50), (3, 50), (1, 70000), (3, 70000)]
    assert all(r["whole_table_s"] > 0 and r["chunked_s"] > 0 for r in rows)
    assert capsys.readouterr().out.count("x |") == 4
