"""Loading a model: its weights (an HF directory's safetensors, a GGUF file read in place, or dummy weights) into
the model code, and its tokenizer; ``load_model`` fills the config's derived model fields (hf_config, model_path,
EOS ids, max_model_len).

Where the directory comes from (a local directory, a .gguf file's described directory, a hub id, or the embedded
default model) is model_sources.py; the dummy architectures and their seeded weights are dummy_model.py. A GGUF
file's blocks stay in their formats on the CPU (``--cpu-weights file``) and are de-quantized on the device
otherwise (engine/weights/).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.config import EngineConfig
from engine.layers.gguf_linear import GGUFEmbedding
from engine.layers.rotary import position_limit, rope_parameters
from engine.models.registry import model_class
from engine.weights.gguf_file import GGUFFile
from engine.weights.gguf_model_dir import gguf_file_of
from engine.weights.gguf_weights import gguf_weights
from engine.worker.dummy_model import dummy_hf_config, dummy_weights
from engine.worker.model_sources import DEFAULT_MODEL_ID, ensure_default_model, resolve_model
from engine.worker.tokenizer_files import eos_token_ids, load_tokenizer
from engine.free_heap import release_free_heap
from kernels import cpu_native

logger = logging.getLogger(__name__)


def load_model(config: EngineConfig, with_tokenizer: bool = True) -> tuple[nn.Module, Any | None]:
    """Build the model with its weights on ``config.torch_device``; fill the config's derived model fields.
    Returns (model, tokenizer); the tokenizer is None for a dummy architecture (and unless ``with_tokenizer``:
    ``load_tokenizer(config.model_path)`` then loads it)."""
    start = time.perf_counter()
    hf_config, path, tokenizer = _resolve(config, with_tokenizer)
    config.hf_config, config.model_path = hf_config, str(path) if path else None
    config.eos_token_ids = eos_token_ids(hf_config.eos_token_id, path)
    max_position = position_limit(rope_parameters(hf_config), hf_config.max_position_embeddings)
    if config.max_model_len is not None and config.max_model_len > max_position:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's {max_position} positions"
        )
    config.max_model_len = config.max_model_len or max_position
    with _default_dtype(config.torch_dtype), config.torch_device:
        model = model_class(hf_config)(hf_config)
    model.to(config.torch_dtype)
    gguf = gguf_file_of(path) if path is not None else None
    if config.load_format == "dummy":
        model.load_weights(dummy_weights(hf_config, config.seed, config.torch_device))
    elif gguf is not None:
        _load_gguf(model, config, gguf)
    else:
        model.load_weights(_safetensors_weights(path))
    if config.torch_device.type == "cpu" and gguf is None:
        _apply_cpu_weights(model, config)
    model.eval().requires_grad_(False)
    # (the load's transients: the tokenizer's parse, the file's metadata, the repack's buffers)
    release_free_heap()
    logger.info(
        "model %s loaded in %.2f s (%.1fM parameters, %s, %s%s)",
        config.model_id,
        time.perf_counter() - start,
        model.num_parameters / 1e6,
        config.torch_dtype,
        config.torch_device,
        f", {config.cpu_weights} weights" if config.torch_device.type == "cpu" else "",
    )
    return model, tokenizer


def _apply_cpu_weights(model: nn.Module, config: EngineConfig) -> None:
    """Resolve ``cpu_weights`` for float weights (auto: float32) and swap the model's linear layers."""
    if config.cpu_weights in (
        "auto",
        "file",
    ):  # (file: a model without a GGUF file has no blocks to keep)
        config.cpu_weights = "float32"
    if config.cpu_weights == "float32":
        return
    model.quantize_cpu_weights(config.cpu_weights, _native(config))


def _native(config: EngineConfig) -> cpu_native.CpuKernels | None:
    return cpu_native.load(Path(config.cache_dir) / "native", config.cpu_isa)


def _load_gguf(model: nn.Module, config: EngineConfig, gguf_path: Path) -> None:
    """A GGUF file's weights, read in place: on the CPU with ``file`` (auto, at float32 on one rank) each layer in
    its file's block format and the embedding looked up in the map; otherwise de-quantized into the model's dtype
    on its device, then (CPU) the ``cpu_weights`` layers built from them."""
    gguf = GGUFFile(gguf_path)
    cpu = config.torch_device.type == "cpu"
    if config.cpu_weights == "auto":
        plain = config.torch_dtype == torch.float32 and config.tensor_parallel_size == 1
        config.cpu_weights = "file" if cpu and plain else "float32"
    if not (cpu and config.cpu_weights == "file"):
        model.load_weights(
            gguf_weights(gguf, config.hf_config, config.torch_dtype, config.torch_device)
        )
        gguf.close()
        if cpu:
            _apply_cpu_weights(model, config)
        return
    model.load_weights(gguf_weights(gguf, config.hf_config, None))
    table = gguf.tensors["token_embd.weight"]
    embedding = GGUFEmbedding(table) if "model.embed_tokens.weight" in model.file_blocks else None
    # (the map's pages read while repacking leave this process layer by layer; lookups fault rows in)
    model.quantize_cpu_weights("file", _native(config), embedding, gguf.release_pages)
    gguf.release_pages()


def _resolve(config: EngineConfig, with_tokenizer: bool) -> tuple[Any, Path | None, Any | None]:
    if config.load_format == "dummy" and config.model is None:
        config.model_id = f"dummy:{config.model_config}"
        return dummy_hf_config(config.model_config), None, None
    path = (
        resolve_model(config.model, Path(config.cache_dir))
        if config.model
        else ensure_default_model(Path(config.cache_dir))
    )
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {path} is not a Hugging Face model directory (no config.json)")
    if (gguf := gguf_file_of(path)) is not None and not gguf.is_file():
        raise ValueError(f"model: {gguf} (described in {path}) is gone")
    config.model_id = config.model or DEFAULT_MODEL_ID
    hf_config = SimpleNamespace(**json.loads((path / "config.json").read_text()))
    return hf_config, path, load_tokenizer(path) if with_tokenizer else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's files as transformers picks them: the index's shards, else ``model.safetensors``, else
    every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(
            {path / name for name in json.loads(index.read_text())["weight_map"].values()}
        )
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _safetensors_weights(path: Path) -> Iterator[tuple[str, Any]]:
    """Each tensor as a lazy slice: a tensor-parallel rank reads only its part of it."""
    files = _weight_files(path)
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    for file in tqdm(files, desc="loading weights", disable=len(files) < 2):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
