"""A GGUF model as a Hugging Face directory for transformers, the tests' oracle: the config and tokenizer pagedchat
describes from the file's metadata, and every tensor de-quantized to float32 by engine/weights (whose formulas
tests/kernels/test_gguf_kernels.py holds equal to the gguf package's), so transformers computes with the very
weights the engine's float32 mode loads. Written once per file into the cache dir."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from engine.weights.gguf_file import GGUFFile
from engine.weights.gguf_model_dir import GGUF_LINK, gguf_file_of, gguf_model_dir
from engine.weights.gguf_weights import gguf_weights


def hf_directory(gguf_file: Path, cache_dir: Path) -> Path:
    """The HF directory (config, tokenizer, float32 model.safetensors) of ``gguf_file``."""
    described = gguf_model_dir(gguf_file, cache_dir)
    target = described.with_name(described.name + "-hf")
    if (target / "model.safetensors").is_file():
        return target
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            _export(described, target)
            _prune_exports(target.parent)
    return target


def _prune_exports(models_dir: Path) -> None:
    """Remove the exports whose description is gone (engine/weights/gguf_model_dir.py prunes those of files that
    are gone): float32 copies of whole models, they would fill the cache dir run after run."""
    for export in models_dir.glob("*-hf"):
        if not export.with_name(export.name.removesuffix("-hf")).is_dir():
            shutil.rmtree(export, ignore_errors=True)
            (models_dir / f".{export.name}.lock").unlink(missing_ok=True)


def _export(described: Path, target: Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(described, tmp, ignore=shutil.ignore_patterns(GGUF_LINK))
    config = SimpleNamespace(**json.loads((described / "config.json").read_text()))
    gguf = GGUFFile(gguf_file_of(described))
    tensors = {name: t.contiguous() for name, t in gguf_weights(gguf, config, torch.float32)}
    _fuse_experts(tensors, config)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    gguf.close()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _fuse_experts(tensors: dict[str, torch.Tensor], config: SimpleNamespace) -> None:
    """A GGUF's experts, stacked per projection (``mlp.experts.gate_proj.weight`` ...), under transformers 5's
    fused names: ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``."""
    experts = getattr(config, "num_local_experts", None)
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj.weight")]:
        prefix = name.removesuffix(".gate_proj.weight")
        gate = tensors.pop(name).view(experts, -1, config.hidden_size)
        up = tensors.pop(f"{prefix}.up_proj.weight").view(experts, -1, config.hidden_size)
        down = tensors.pop(f"{prefix}.down_proj.weight")
        tensors[f"{prefix}.gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
        tensors[f"{prefix}.down_proj"] = down.view(experts, config.hidden_size, -1).contiguous()
