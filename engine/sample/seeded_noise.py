"""Counter-based Exp(1) noise for seeded rows: E_i = -log(u_i), with u_i from output i of splitmix64 started at
the row's key = mix(mix(seed) + number of output tokens so far), for token id i.

A pure function of (seed, position, token id), in wrapping int64 arithmetic on the device, so every device
agrees bit for bit on the integers (and up to float rounding on the noise).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's state increment
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's finaliser
_SHIFTS = (30, 27, 31)


def draw_key(seed: int, position: int) -> int:
    """The key of a seeded row's draw of its `position`-th output token: mix(mix(seed) + position), as int64."""
    key = _mix64((_mix64(seed & _MASK64) + position) & _MASK64)
    return _signed(key)


def splitmix64(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[len(keys), count] int64: outputs 1..count of splitmix64 started at each key (output n is
    mix(key + n * golden)), in wrapping int64 arithmetic, so that every device agrees bit for bit."""
    z = _mixed(keys, torch.arange(1, count + 1, device=keys.device) * _signed(_GOLDEN))
    return z.bitwise_xor_(_shift_right(z, _SHIFTS[-1]))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[len(keys), vocab] float32 Exp(1) noise, a pure function of each key and token id: -log(u) with
    u = (2m + 1) / 2^24 = m / 2^23 + 2^-24 from the top 23 bits m of the token's splitmix64 output (exact in
    float32, in (0, 1)). The finaliser's last step, z ^ (z >>> 31), leaves those bits as they are: skipped.

    On the CPU a few rows at a time (``_CPU_CHUNK_ELEMENTS`` int64s), so the hash's temporaries stay in the
    cache: 200 rows of a 49k vocabulary took 0.77 s at one thread all at once, 0.13 s this way."""
    steps = torch.arange(1, vocab + 1, device=keys.device) * _signed(_GOLDEN)
    out = torch.empty(len(keys), vocab, dtype=torch.float32, device=keys.device)
    chunk = max(1, _CPU_CHUNK_ELEMENTS // vocab if keys.device.type == "cpu" else len(keys))
    for start in range(0, len(keys), chunk):
        part = out[start : start + chunk]
        _exponential_(part.copy_(_shift_right(_mixed(keys[start : start + chunk], steps), 41)))
    return out


_CPU_CHUNK_ELEMENTS = 1 << 17  # (1 MiB of int64 per temporary)


def exponential_noise_at(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``exponential_noise(keys, vocab)`` at [len(keys), k] token ids only (row r's at ``ids[r]``): the same
    floats, for a race among a few tokens (the kept ones of a top-p or a grammar's row) at a few k's cost."""
    z = _mixed(keys, (ids + 1) * _signed(_GOLDEN))
    return _exponential_(_shift_right(z, 41).to(torch.float32))


def _exponential_(top: torch.Tensor) -> torch.Tensor:
    """In place, float32 holding the top 23 bits m of each output: -log(m / 2^23 + 2^-24)."""
    return top.mul_(2.0**-23).add_(2.0**-24).log_().neg_()


def _mixed(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """splitmix64's state for each key and step (``steps``: [n], or [len(keys), n] per key), through the
    finaliser's two multiplications (not its last xor-shift)."""
    z = keys[:, None] + steps
    for shift, multiplier in zip(_SHIFTS, _MULTIPLIERS):
        z.bitwise_xor_(_shift_right(z, shift)).mul_(_signed(multiplier))
    return z


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int in [0, 2^64)."""
    for shift, multiplier in zip(_SHIFTS, _MULTIPLIERS):
        z = ((z ^ (z >> shift)) * multiplier) & _MASK64
    return z ^ (z >> _SHIFTS[-1])


def _shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value
