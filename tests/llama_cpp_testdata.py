"""Real tokenizers and chat templates for tests, without Hugging Face: llama.cpp keeps vocabulary-only GGUF files
and many models' chat templates as test data, and the llama-cpp-python sdist on PyPI vendors that tree. The first
caller downloads the sdist with pip (PyPI is what `make install` already needs) and keeps only the files below in
the cache dir; later callers, and other pytest-xdist workers, read them there."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from engine.config import EngineConfig

SDIST = "llama-cpp-python==0.3.36"
_MODELS = "vendor/llama.cpp/models/"
# the vocabulary of Qwen2, Qwen2.5 and Qwen3 (byte-level BPE, 151936 ids), and the templates tests render
VOCABULARIES = ("ggml-vocab-qwen2.gguf",)
TEMPLATES = (
    "Qwen-Qwen3-0.6B",
    "Qwen-Qwen2.5-7B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
)


def llama_cpp_models_dir(cache_dir: Path | None = None) -> Path:
    """A directory holding ``VOCABULARIES`` and ``templates/<name>.jinja`` for each of ``TEMPLATES``, under
    ``cache_dir`` (the engine's default cache dir: ``PAGEDCHAT_CACHE_DIR``). RuntimeError with pip's own output
    when the download fails."""
    root = Path(cache_dir or EngineConfig().cache_dir) / "testdata"
    target = root / SDIST.replace("==", "-")
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one downloader; the others wait, then find it done
        if not _complete(target):
            _download(target)
    return target


def chat_template(name: str, cache_dir: Path | None = None) -> str:
    """The chat template of ``name`` (one of ``TEMPLATES``), as its model's tokenizer_config.json gives it."""
    if name not in TEMPLATES:
        raise ValueError(f"template_name: {name!r} is not one of {TEMPLATES}")
    return (llama_cpp_models_dir(cache_dir) / "templates" / f"{name}.jinja").read_text()


def _wanted() -> dict[str, str]:
    """sdist member suffix -> path in the target directory."""
    files = {_MODELS + name: name for name in VOCABULARIES}
    files.update({f"{_MODELS}templates/{n}.jinja": f"templates/{n}.jinja" for n in TEMPLATES})
    return files


def _complete(target: Path) -> bool:
    return all((target / path).is_file() for path in _wanted().values())


def _download(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*command, SDIST, "-d", scratch], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"pip download {SDIST} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        (sdist,) = Path(scratch).glob("*.tar.gz")
        staged = Path(scratch) / "staged"
        _extract(sdist, staged)
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)  # whole or absent: a reader never sees half of it


def _extract(sdist: Path, staged: Path) -> None:
    """Only the wanted members, by name (never the archive's own paths), read in one pass over the archive."""
    wanted = _wanted()
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            # (members are named "<project>-<version>/vendor/...")
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name in wanted:
                out = staged / wanted[name]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.extractfile(member).read())
    missing = [path for path in wanted.values() if not (staged / path).is_file()]
    if missing:
        raise RuntimeError(f"{sdist.name} lacks {missing}")
