"""Builds and loads the native CPU kernels: kernels/cpu_decode.cpp (the decode step, and the ops' registration),
kernels/cpu_attention.cpp (its paged attention) and the quantized matmuls (kernels/cpu_quant_matmul.cpp,
cpu_gguf_matmul.cpp, cpu_gguf_repack.cpp), for one instruction-set level.

Levels (``--cpu-isa`` / ``PAGEDCHAT_CPU_ISA``), each a superset of the one before:

- ``avx2``: x86-64-v3 (AVX2, FMA, F16C; AMD Zen 1-3, Intel client CPUs, most cloud instances);
- ``avx512``: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL);
- ``avx512_vnni``: x86-64-v4 with AVX-512 VNNI (vpdpbusd: the Q4_1 x Q8 products in one instruction);
- ``generic``: the compiler's baseline target (x86-64 without AVX; any other CPU), the same kernels written lane
  by lane in plain C++ (kernels/cpu_simd.h): slower, bit-equal to the vector levels; every CPU can run it;
- ``auto``: the highest level this CPU has; ``generic`` where it has none of them (not x86, or x86 before AVX2).

Any level the CPU has can be forced, so every level is built, tested and benchmarked on one machine; a level the
CPU lacks is refused with a ValueError naming ``cpu_isa`` (its code would die of SIGILL). Each level is its own
library, with its own op namespace (``torch.ops.pagedchat_cpu_avx2``, ...), so one process can hold several.

Compiled with OpenMP: ``at::parallel_for`` is a header template whose ``#pragma omp parallel`` only takes effect in
code compiled with ``-fopenmp`` (without it every kernel ran on one thread). Built once per machine with the C++
compiler torch's extension builder finds (~30 s on two cores), into
``build_root/<tag>``, where the tag names the torch version and the level (x86-64-v3, x86-64-v4,
x86-64-v4-vnni), so a cache shared between CPUs or torch versions never loads a wrong binary; later starts load
it in well under a second. Without a compiler, or if the build fails, ``load`` returns None and the caller keeps
the Python path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ISA_LEVELS = ("avx2", "avx512", "avx512_vnni")  # ascending; each needs the flags of the ones before
CPU_ISA_CHOICES = ("auto", "generic", *ISA_LEVELS)
_SOURCES = [
    Path(__file__).with_name(name)
    # (the longest compile first: ninja starts them in this order, and one started last ran alone for 50 s)
    for name in (
        "cpu_gguf_matmul.cpp",
        "cpu_decode.cpp",
        "cpu_attention.cpp",
        "cpu_quant_matmul.cpp",
        "cpu_gguf_repack.cpp",
    )
]
_X86_64_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_NEEDS = {"avx2": _X86_64_V3, "avx512": _X86_64_V4, "avx512_vnni": _X86_64_V4 | {"avx512_vnni"}}
_TARGETS = {  # level -> (build tag, compiler flags)
    "avx2": ("x86-64-v3", ["-march=x86-64-v3"]),
    "avx512": ("x86-64-v4", ["-march=x86-64-v4"]),
    "avx512_vnni": ("x86-64-v4-vnni", ["-march=x86-64-v4", "-mavx512vnni"]),
}
if platform.machine() in ("x86_64", "AMD64"):  # (elsewhere the compiler's own default target)
    _TARGETS["generic"] = ("x86-64", ["-march=x86-64"])


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """The native kernels of one level, loaded: ``ops`` is their op namespace (``ops.decode_layers_q8``, ...)."""

    level: str
    ops: Any  # torch._ops._OpNamespace


_loaded: dict[str, CpuKernels | None] = {}


@functools.cache  # (EngineConfig checks cpu_isa on every construction: /proc/cpuinfo is read once)
def _cpu_flags() -> frozenset[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_levels() -> list[str]:
    """The levels this CPU can run, ascending (empty: only the generic build)."""
    flags = _cpu_flags()
    return [level for level in ISA_LEVELS if _NEEDS[level] <= flags]


def resolve_isa(requested: str) -> str:
    """``requested`` (one of CPU_ISA_CHOICES) as the level to build: auto -> the highest this CPU has (generic
    where none); raises ValueError naming ``cpu_isa`` for an unknown value or a level this CPU lacks."""
    if requested not in CPU_ISA_CHOICES:
        raise ValueError(
            f"cpu_isa: must be one of {', '.join(CPU_ISA_CHOICES)} (got {requested!r})"
        )
    levels = supported_levels()
    if requested == "auto":
        return levels[-1] if levels else "generic"
    if requested != "generic" and requested not in levels:
        missing = sorted(_NEEDS[requested] - _cpu_flags())
        raise ValueError(
            f"cpu_isa: this CPU cannot run {requested} code (it lacks {', '.join(missing)}); "
            f"levels it can run: {', '.join(['auto', 'generic', *levels])}"
        )
    return requested


def load(build_root: Path, isa: str = "auto") -> CpuKernels | None:
    """The native kernels of level ``isa`` (building them on first use), or None where they cannot be built or
    ``PAGEDCHAT_CPU_NATIVE=0``; raises ValueError for a level this CPU lacks."""
    level = resolve_isa(isa)
    if os.environ.get("PAGEDCHAT_CPU_NATIVE", "1") == "0":
        return None
    if level not in _loaded:
        _loaded[level] = _build(build_root, level)
    return _loaded[level]


def build_directory(build_root: Path, tag: str, sources: Path) -> Path:
    """Where the kernels of ``tag`` built from the sources in ``sources`` live: one directory per torch version,
    level and checkout (torch rebuilds a directory whose sources come from another path, so two installs on one
    machine sharing one would rebuild each other's at every start, ~15 s and silently)."""
    place = hashlib.sha256(str(sources.resolve()).encode()).hexdigest()[:8]
    return build_root / f"cpu_decode-torch{torch.__version__.replace('+', '-')}-{tag}-{place}"


def _build(build_root: Path, level: str) -> CpuKernels | None:
    tag, arch = _TARGETS.get(level, (platform.machine() or "generic", []))
    name = f"pagedchat_cpu_{level}"
    build_dir = build_directory(build_root, tag, _SOURCES[0].parent)
    start = time.perf_counter()
    # the ninja that pip installed beside this Python (on PATH only in an activated virtual environment)
    os.environ["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )
    try:
        from torch.utils.cpp_extension import load as build

        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            logger.info(
                "building the native CPU kernels for %s (once per machine, ~15-30 s): %s",
                level,
                build_dir,
            )
        build(
            name,
            [str(source) for source in _SOURCES],
            build_directory=str(build_dir),
            extra_include_paths=[str(_SOURCES[0].parent)],
            is_python_module=False,
            # -fno-trapping-math: floating-point exceptions are never looked at, which lets the compiler
            # vectorize floor (exp_fast's, in SiLU, GeLU and softmax: one element at a time without it); it
            # changes no value
            extra_cflags=[
                "-O3",
                "-fopenmp",
                "-fno-trapping-math",
                f"-DPAGEDCHAT_CPU_NS={name}",
                *arch,
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a failed build: the Python path still works
        logger.warning(
            "native CPU kernels unavailable (%s: %s); using the Python path",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return None
    ops = getattr(torch.ops, name)
    built = str(ops.isa())
    if built != level:  # a compiler that ignored the flags: the level's promise would not hold
        raise RuntimeError(
            f"the native CPU kernels for {level} were compiled as {built} ({build_dir})"
        )
    logger.info(
        "native CPU kernels loaded in %.2f s (%s, %s)", time.perf_counter() - start, level, tag
    )
    return CpuKernels(level, ops)
