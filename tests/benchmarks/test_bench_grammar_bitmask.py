"""benchmarks.kernel.grammar_bitmask: the way it times against is the engine's unpacking (the script asserts the two
masks equal), and its report holds one row per shape."""

from __future__ import annotations

import json

import torch

from benchmarks.kernel.grammar_bitmask import main, shifted_words
from engine.sample.logits_processors import unpack_bitmask


def test_the_old_unpacking_is_the_engines_and_the_report_has_every_shape(tmp_path, capsys):
    mask = torch.tensor([[-1, 5, -(2**31)], [7, 0, 2**31 - 1]], dtype=torch.int32)
    assert torch.equal(shifted_words(mask, 70), unpack_bitmask(mask, 70))
    path = tmp_path / "bitmask.json"
    main(["--rows", "2", "--vocab", "40", "1000", "--repeats", "1", "--json", str(path)])
    report = json.loads(path.read_text())
    shapes = {(r["rows"], r["vocab"]): min(r["shifted_ms"], r["table_ms"]) for r in report["rows"]}
    assert set(shapes) == {(2, 40), (2, 1000)} and min(shapes.values()) > 0
    printed = capsys.readouterr().out
    assert printed.count("| 2 | ") == 2 and "byte table ms" in printed
