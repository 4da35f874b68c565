"""benchmarks/kernel/persistent_decode.py --trace: the profile gives each segment its share of the launch."""

import pytest
import torch

from benchmarks.kernel.persistent_decode import SEGMENTS, make_batch, phase_profile
from kernels.persistent_decode import STAMPS_PER_LAYER


def synthetic_trace(programs: int, layers: int) -> tuple[torch.Tensor, list[float]]:
    """Stamps where segment k of every layer takes (k + 1) us for the latest program, which is program
    ``programs - 1`` (others get there earlier by a random amount): the expected shares, in us."""
    gen = torch.Generator().manual_seed(0)
    slots = 2 + STAMPS_PER_LAYER * layers
    latest = torch.zeros(slots, dtype=torch.int64)
    latest[1] = 5_000
    for layer in range(layers):
        for k, (_, first, last, _) in enumerate(SEGMENTS):
            base = 2 + STAMPS_PER_LAYER * layer
            before = base + first if first >= 0 or layer else 1
            latest[base + last] = latest[before] + (k + 1) * 1_000
    early = torch.randint(0, 900, (programs, slots), generator=gen)
    early[-1] = 0
    return latest[None, :] - early, [float(k + 1) for k in range(len(SEGMENTS))]


def test_the_profile_gives_each_segment_its_share_and_the_shares_add_up() -> None:
    layers = 3
    trace, want = synthetic_trace(programs=5, layers=layers)
    profile = phase_profile(trace)
    assert [row["segment"] for row in profile] == [name for name, *_ in SEGMENTS]
    assert [row["share_us"] for row in profile] == pytest.approx(want)
    launch_us = (trace[:, -1].max() - trace[:, 1].max()).item() / 1e3
    assert sum(row["total_us"] for row in profile) == pytest.approx(launch_us)
    # a program that got somewhere earlier spent less there than the latest one
    assert all(row["spent_us"] <= row["share_us"] + 0.9 for row in profile)
    gate_up = next(row for row in profile if row["segment"].startswith("gate/up"))
    assert gate_up["tb_s"] == pytest.approx(SEGMENTS[5][3] / 6.0 / 1e6)


def test_each_sequence_has_its_own_blocks_unless_shared() -> None:
    own = make_batch(3, 40, 256, torch.device("cpu"))
    used = own["block_tables"][:, :3]  # 40 tokens: 3 blocks of 16 a sequence
    assert used.unique().numel() == 9
    assert own["slot_mapping"].unique().numel() == 3
    shared = make_batch(3, 40, 256, torch.device("cpu"), shared=True)
    assert torch.equal(shared["block_tables"], shared["block_tables"][:1].expand(3, -1))
    assert torch.equal(shared["block_tables"][0], own["block_tables"][0])
    assert shared["slot_mapping"].unique().numel() == 1
    # the new token's slot lies in the last block the table names
    slot = int(shared["slot_mapping"][0])
    assert slot // 16 == int(shared["block_tables"][0, 2]) and slot % 16 == (40 - 1) % 16
