"""The EngineConfig fields that depend on the device the engine runs on, and the options a device cannot run.

``EngineConfig.resolve()`` calls ``resolve_device_fields`` where the engine runs (its core process, an offline
engine): it imports torch and asks CUDA. The server's front never calls it: it checks the options' values, sends
them to the core and learns what the core resolved from its CoreInfo.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.cpu_native import resolve_isa

FP8_MIN_CAPABILITY = (8, 9)  # e4m3 in Triton and the hardware: Ada (sm89), Hopper (sm90) and newer
LARGE_GPU_BYTES = 70 * 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_fields(config: Any) -> None:
    """Fill ``config``'s device, dtype and the step limits left to the device (None), in place (an EngineConfig;
    typed loosely: engine.config imports this module inside ``resolve``)."""
    resolve_isa(config.cpu_isa)  # (a ValueError naming cpu_isa for a level this CPU cannot run)
    device = resolve_device(config.device)
    _check_tensor_parallel_devices(config, device)
    _check_kv_cache_dtype(config, device)
    on_cuda = device.type == "cuda"
    _check(
        config.kv_backend != "vattention" or on_cuda,
        "kv_backend",
        "vattention needs a CUDA device (it maps GPU pages with the CUDA driver); use paged on the CPU",
    )
    _check(
        config.cpu_weights in ("auto", "float32") or not on_cuda,
        "cpu_weights",
        f"{config.cpu_weights} is for the CPU; on CUDA the weights are in the model dtype",
    )
    large = is_large_gpu(device)
    if config.max_num_seqs is None:
        config.max_num_seqs = 1024 if large else 256
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = 8192 if large else 2048
    if config.max_graph_batch_size is None:
        config.max_graph_batch_size = 256 if on_cuda else 0
    if config.shared_step_time_factor is None:
        config.shared_step_time_factor = 1.2 if on_cuda else 1.5
    if config.step_time_target_s is None:
        config.step_time_target_s = 0.0 if on_cuda else 0.25
    if config.async_scheduling is None:
        config.async_scheduling = on_cuda
    if config.dtype == "auto":
        config.torch_dtype = torch.bfloat16 if on_cuda else torch.float32
    else:
        config.torch_dtype = _DTYPES[config.dtype]
    # (last: set means resolved)
    config.torch_device = device


def resolve_device(device: str) -> torch.device:
    """The one place that decides where the engine runs."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {device!r} is not a torch device") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no CUDA device is available")
    _check(resolved.type in ("cpu", "cuda"), "device", "must be cpu or cuda")
    return resolved


def is_large_gpu(device: torch.device) -> bool:
    """A CUDA device where larger step limits pay (vLLM's rule: >= 70 GiB and not an A100, where a larger
    token budget measured slower)."""
    if device.type != "cuda":
        return False
    properties = torch.cuda.get_device_properties(device)
    return properties.total_memory >= LARGE_GPU_BYTES and "a100" not in properties.name.lower()


def _check_tensor_parallel_devices(config: Any, device: torch.device) -> None:
    size = config.tensor_parallel_size
    if size == 1 or device.type != "cuda":
        return
    count = torch.cuda.device_count()
    _check(
        size <= count, "tensor_parallel_size", f"{size} exceeds the {count} visible CUDA devices"
    )
    _check(
        device.index in (None, 0),
        "device",
        "with tensor parallelism the ranks take cuda:0 .. N-1: "
        "give cuda (choose the devices with CUDA_VISIBLE_DEVICES)",
    )


def _check_kv_cache_dtype(config: Any, device: torch.device) -> None:
    """fp8 on CUDA needs e4m3 in hardware and Triton (compute capability 8.9+); the CPU converts in torch."""
    if config.kv_cache_dtype != "fp8" or device.type != "cuda":
        return
    capability = tuple(torch.cuda.get_device_capability(device))
    _check(
        capability >= FP8_MIN_CAPABILITY,
        "kv_cache_dtype",
        f"fp8 (e4m3) needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
        f"{capability[0]}.{capability[1]}: use auto",
    )


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
