"""Builds and loads the native CPU kernels (``torch.ops.pagedchat_cpu``): kernels/cpu_decode.cpp (the decode
step, and the ops' registration) and kernels/cpu_quant_matmul.cpp (the quantized matmuls).

Built once per machine with the C++ compiler torch's extension builder finds (~10 s on two cores), into
``build_root/<tag>``, where the tag names the torch version and the instruction set the code was compiled for
(x86-64-v4 plus VNNI where the CPU has AVX-512 VNNI: then the Q4_1 x Q8 kernels exist; x86-64-v4 with AVX-512;
x86-64-v3 with AVX2 and FMA; the compiler's default otherwise), so a cache shared between different CPUs or
torch versions never loads a wrong binary; later starts load it in well under a second.
Without a compiler, or if the build fails, ``load`` returns False and the caller keeps the Python path.
"""
from __future__ import annotations

import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_quant_matmul.cpp")]
_X86_64_V3 = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_loaded: bool | None = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _arch_flags() -> tuple[str, list[str]]:
    flags = _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    if _X86_64_V4 | {"avx512_vnni"} <= flags:
        return "x86-64-v4-vnni", ["-march=x86-64-v4", "-mavx512vnni"]
    for level, needs in (("x86-64-v4", _X86_64_V4), ("x86-64-v3", _X86_64_V3)):
        if needs <= flags:
            return level, [f"-march={level}"]
    return platform.machine() or "generic", []


def load(build_root: Path) -> bool:
    """Whether ``torch.ops.pagedchat_cpu.decode_layers`` is available (building it on first use)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if os.environ.get("PAGEDCHAT_CPU_NATIVE", "1") == "0":
        _loaded = False
        return False
    tag, arch = _arch_flags()
    build_dir = build_root / f"cpu_decode-torch{torch.__version__.replace('+', '-')}-{tag}"
    start = time.perf_counter()
    # the ninja that pip installed beside this Python (on PATH only in an activated virtual environment)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load as build

        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            logger.info("building the native CPU decode step (once per machine, ~30 s): %s", build_dir)
        build("pagedchat_cpu_decode", [str(source) for source in _SOURCES], build_directory=str(build_dir),
              extra_include_paths=[str(_SOURCES[0].parent)], is_python_module=False,
              extra_cflags=["-O3", "-fopenmp-simd", *arch], verbose=False)
    except Exception as exc:  # no compiler, no headers, a failed build: the Python path still works
        logger.warning("native CPU decode step unavailable (%s: %s); using the Python path",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        _loaded = False
        return False
    logger.info("native CPU decode step loaded in %.2f s (%s)", time.perf_counter() - start, tag)
    _loaded = True
    return True


def has_q4q8() -> bool:
    """Whether the loaded kernels include the Q4_1 x Q8 matmul (built for a CPU with AVX-512 VNNI)."""
    return bool(_loaded) and bool(torch.ops.pagedchat_cpu.has_q4q8())
