"""Triton's interpreter rounds float32 -> bfloat16 toward zero where a GPU rounds to nearest even: kernel tests
that compare bfloat16 outputs bit for bit patch it to round as the GPU does (through torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def round_bfloat16_like_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def round_to_nearest_even(values: np.ndarray, src, dst, rounding_mode) -> np.ndarray:
        if (src, dst) != (tl.float32, tl.bfloat16):
            return convert(values, src, dst, rounding_mode)
        as_float = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
        return (
            as_float.to(torch.bfloat16)
            .view(torch.int16)
            .numpy()
            .view(np.uint16)
            .reshape(values.shape)
        )

    monkeypatch.setattr(interpreter, "_convert_float", round_to_nearest_even)
