"""A GGUF model's directory in the cache: the config.json, generation_config.json and tokenizer that its metadata
describes, written once (keyed by the file's path, size and modification time, and the description's version: an
edited file gets a new one).
The weights stay in the GGUF file and are read from it in place at every start; the directory holds a few MB.

The first start builds the tokenizer from the metadata (a SentencePiece vocabulary without merges, as Gemma's,
has them derived: the slow part, ~5-15 s for 262k tokens); later starts read it back in well under a second.

Describing a file also removes the descriptions no start can use again (``prune_descriptions``): those of files
that are gone (a deleted download, a removed virtual environment's packaged model, a test's temporary file) and the
older ones of the file just described (edited, or described by an older version), once untouched for
``STALE_AFTER_S``. Without it the directory only grew: every edited or moved file left its description behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from engine.weights.gguf_config import hf_config
from engine.weights.gguf_file import GGUFFile
from engine.weights.gguf_tokenizer import build_tokenizer, end_of_turn_ids

logger = logging.getLogger(__name__)

GGUF_LINK = "model.gguf.path"  # in the directory: the GGUF file it describes
# what a directory holds, in the key: a new version describes a file again (2: added tokens in tokenizer_config)
DESCRIPTION_VERSION = 2
# a description this recently written is never removed (another process may be starting from it)
STALE_AFTER_S = 600.0


def gguf_model_dir(gguf_file: Path, cache_dir: Path) -> Path:
    """The directory describing ``gguf_file`` under ``cache_dir/models``, built on first use (one builder at a
    time: parallel workers and replicas wait for it). ValueError naming ``model`` for a bad file."""
    gguf_file = gguf_file.resolve()
    target = described_dir(gguf_file, cache_dir)
    if (target / GGUF_LINK).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / GGUF_LINK).is_file():
            _describe(gguf_file, target)
            prune_descriptions(target.parent, gguf_file, keep=target)
    return target


def prune_descriptions(models_dir: Path, gguf_file: Path, keep: Path) -> list[Path]:
    """Remove the descriptions under ``models_dir`` whose GGUF file is gone, or that describe ``gguf_file`` under
    another key than ``keep`` (an older version of it), when untouched for ``STALE_AFTER_S``; the ones removed."""
    removed = []
    for link in models_dir.glob(f"*/{GGUF_LINK}"):
        entry = link.parent
        if entry == keep or entry.name.endswith(".tmp"):
            continue
        try:
            source = Path(link.read_text())
            age = time.time() - link.stat().st_mtime
        except OSError:  # (another process removed it first)
            continue
        if age < STALE_AFTER_S or (source.exists() and source != gguf_file):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        (models_dir / f".{entry.name}.lock").unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d descriptions of GGUF files gone or described again", len(removed))
    return removed


def described_dir(gguf_file: Path, cache_dir: Path) -> Path:
    """Where ``gguf_file``'s directory is (or will be): keyed by the file's path, size and modification time."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    source = f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}:{DESCRIPTION_VERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{gguf_file.stem}-{key}"


def _describe(gguf_file: Path, target: Path) -> None:
    start = time.perf_counter()
    gguf = GGUFFile(gguf_file)
    config = hf_config(gguf)
    logger.info("reading %s once: its config and tokenizer into %s", gguf_file.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": end_of_turn_ids(gguf)}
    if config.get("bos_token_id") is not None:
        generation["bos_token_id"] = config["bos_token_id"]
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = build_tokenizer(gguf)
    tokenizer.save_pretrained(tmp)
    _list_added_tokens(tmp / "tokenizer_config.json", tokenizer)
    (tmp / GGUF_LINK).write_text(str(gguf_file))
    gguf.close()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    logger.info("%s described in %.1f s", gguf_file.name, time.perf_counter() - start)


def _list_added_tokens(config_path: Path, tokenizer: Any) -> None:
    """The added tokens written into tokenizer_config.json too (``added_tokens_decoder``, as transformers 4 wrote
    it): without them transformers parses the whole tokenizer.json in Python at every load to find them (0.8 s
    of a Gemma start, 33 MB of JSON)."""
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {
        str(i): token.__getstate__()
        for i, token in sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder().items())
    }
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def gguf_file_of(model_dir: Path) -> Path | None:
    """The GGUF file a cached model directory describes (None: an ordinary Hugging Face directory)."""
    link = model_dir / GGUF_LINK
    return Path(link.read_text()) if link.is_file() else None
