"""The cache's GGUF descriptions do not pile up (engine/weights/gguf_model_dir.py ``prune_descriptions``, and the
tests' float32 exports, tests/hf_export.py): describing a file removes the descriptions of files that are gone and
the older ones of the same file, once untouched for ``STALE_AFTER_S``; nothing younger, nothing of a file still
there, never the new one."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from engine.weights.gguf_model_dir import (
    GGUF_LINK,
    STALE_AFTER_S,
    described_dir,
    gguf_model_dir,
    prune_descriptions,
)
from tests.hf_export import _prune_exports
from tests.tiny_qwen3 import cached_tiny_qwen3_gguf


def description(models: Path, name: str, source: Path, age_s: float) -> Path:
    """A described directory ``name`` linking ``source``, last written ``age_s`` ago (and its lock file)."""
    entry = models / name
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{}")
    (entry / GGUF_LINK).write_text(str(source))
    when = time.time() - age_s
    os.utime(entry / GGUF_LINK, (when, when))
    (models / f".{name}.lock").touch()
    return entry


def test_prune_removes_the_gone_and_the_superseded_when_old_only(tmp_path):
    models = tmp_path / "models"
    here = tmp_path / "here.gguf"
    other = tmp_path / "other.gguf"
    here.write_bytes(b"x")
    other.write_bytes(b"y")
    old = STALE_AFTER_S + 60
    gone_old = description(models, "gone-aaaa", tmp_path / "deleted.gguf", old)
    gone_young = description(models, "gone-bbbb", tmp_path / "deleted.gguf", 5)
    other_old = description(models, "other-cccc", other, old)
    superseded = description(models, "here-dddd", here, old)
    current = description(models, "here-eeee", here, old)
    building = description(models, "here-ffff.tmp", tmp_path / "deleted.gguf", old)

    removed = prune_descriptions(models, here, keep=current)

    assert sorted(removed) == sorted([gone_old, superseded])
    assert not gone_old.exists() and not superseded.exists()
    assert not (models / ".gone-aaaa.lock").exists()
    for kept in (gone_young, other_old, current, building):
        assert (kept / GGUF_LINK).is_file()
    assert (models / ".other-cccc.lock").exists()


def test_describing_a_file_prunes_the_cache_dir(tmp_path):
    source = cached_tiny_qwen3_gguf()
    gguf = tmp_path / "tiny.gguf"
    shutil.copyfile(source, gguf)
    cache = tmp_path / "cache"
    models = cache / "models"
    old = STALE_AFTER_S + 60
    stale = description(models, "tiny-1234", tmp_path / "was-here.gguf", old)
    # an older description of this very file (say, by an older version): same path, another key
    older = description(models, "tiny-5678", gguf.resolve(), old)
    live = description(models, "other-9999", source, old)

    target = gguf_model_dir(gguf, cache)

    assert target == described_dir(gguf, cache) and (target / GGUF_LINK).is_file()
    assert not stale.exists() and not older.exists()
    assert (live / GGUF_LINK).is_file()
    # a second call finds the description and prunes nothing more
    assert gguf_model_dir(gguf, cache) == target


def test_exports_whose_description_is_gone_are_removed(tmp_path):
    models = tmp_path / "models"
    kept = description(models, "m-1111", tmp_path / "f.gguf", 0)
    (models / "m-1111-hf").mkdir()
    (models / "m-2222-hf").mkdir()
    (models / "m-2222-hf" / "model.safetensors").write_bytes(b"0" * 16)
    (models / ".m-2222-hf.lock").touch()
    (models / "m-3333-hf.tmp").mkdir()

    _prune_exports(models)

    assert kept.is_dir() and (models / "m-1111-hf").is_dir()
    assert not (models / "m-2222-hf").exists() and not (models / ".m-2222-hf.lock").exists()
    assert (models / "m-3333-hf.tmp").is_dir()
