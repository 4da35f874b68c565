"""The llama.cpp peer runs at our level or not at all: its build's system info (the instruction sets ggml was
compiled for) must match the level our kernels run at, so an "avx2" comparison never measures an AVX-512 build."""

from __future__ import annotations

import pytest

from benchmarks.harness.peers import check_level

AVX2_BUILD = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |"
)
VNNI_BUILD = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VNNI = 1 | OPENMP = 1 |"
)


@pytest.mark.parametrize(
    "info, level",
    [
        (AVX2_BUILD, "avx2"),
        (AVX2_BUILD, "generic"),
        (VNNI_BUILD, "avx512_vnni"),
        (AVX2_BUILD, "avx512"),
    ],
)
def test_a_build_of_the_level_is_taken(info: str, level: str):
    check_level(info, level)


@pytest.mark.parametrize(
    "info, level", [(VNNI_BUILD, "avx2"), (VNNI_BUILD, "generic"), (AVX2_BUILD, "avx512_vnni")]
)
def test_a_build_of_another_level_is_refused_naming_it(info: str, level: str):
    with pytest.raises(SystemExit, match=f"does not match the level {level}"):
        check_level(info, level)
