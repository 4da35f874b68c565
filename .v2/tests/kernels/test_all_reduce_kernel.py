"""The peer all-reduce kernel's arithmetic (kernels/all_reduce.py) in Triton's interpreter: the ranks are emulated
one after another in one process, their buffers slices of one tensor, the barriers off (``sync=False``; the two
shot in its two phases). The barriers themselves and the real peers run in tests/gpu/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

# (before triton loads; the CPU has no other way to run it)
os.environ.setdefault("TRITON_INTERPRET", "1")
all_reduce = pytest.importorskip("kernels.all_reduce", reason="Triton is not installed")


def _side_by_side(
    parts: list[torch.Tensor], gap: int
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The ranks' buffers as slices of one tensor (rank r's ``r * stride`` elements in; ``gap`` keeps each
    start 32-byte aligned), each holding its part: (memory, staged views, stride)."""
    numel = parts[0].numel()
    stride = numel + gap
    memory = torch.zeros(len(parts) * stride, dtype=parts[0].dtype)
    staged = [
        memory[r * stride : r * stride + numel].view(parts[0].shape) for r in range(len(parts))
    ]
    for view, part in zip(staged, parts):
        view.copy_(part)
    return memory, staged, stride


def _emulate(
    parts: list[torch.Tensor], two_shot: bool, programs: int, block: int
) -> list[torch.Tensor]:
    world = len(parts)
    _, staged, stride = _side_by_side(parts, 48)
    pad = torch.zeros(2 * programs * world, dtype=torch.int32)
    outs = [torch.full_like(parts[0], float("nan")) for _ in range(world)]

    def call(rank: int, phase: int) -> None:
        deltas = tuple((r - rank) * stride for r in range(world))
        all_reduce.all_reduce_staged(
            staged[rank],
            outs[rank],
            pad,
            deltas,
            (0,) * world,
            rank,
            programs,
            two_shot=two_shot,
            block=block,
            sync=False,
            phase=phase,
        )

    for phase in (1, 2) if two_shot else (0,):
        for rank in range(world):
            call(rank, phase)
    assert not pad.any()
    return outs


@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("world,numel,programs", [(2, 1000, 3), (2, 4096, 4), (4, 1234, 2)])
def test_every_rank_gets_the_sum_of_every_ranks_part(
    two_shot: bool, world: int, numel: int, programs: int
) -> None:
    torch.manual_seed(world * numel)
    parts = [torch.randn(numel) * (r + 1) for r in range(world)]
    want = torch.stack(parts).sum(0)
    for rank, out in enumerate(_emulate(parts, two_shot, programs, block=64)):
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5, msg=f"rank {rank}")


def test_bfloat16_parts_are_summed_in_float32_and_rounded_once() -> None:
    """Within one bfloat16 step of the float32 sum (the interpreter rounds toward zero, the GPU to nearest);
    bfloat16 partial sums would drift further."""
    torch.manual_seed(0)
    parts = [torch.randn(512).to(torch.bfloat16) for _ in range(4)]
    want = torch.stack([p.float() for p in parts]).sum(0)
    for out in _emulate(parts, True, programs=2, block=64):
        step = 2.0 ** (torch.frexp(want).exponent.float() - 8)
        assert ((out.float() - want).abs() <= step).all()


@pytest.mark.parametrize(
    "world,rows,hidden,programs", [(2, 5, 48, 2), (2, 8, 64, 3), (4, 7, 40, 2)]
)
def test_the_fused_sum_add_and_norm_equals_the_sum_then_the_norm_kernels_reference(
    world: int, rows: int, hidden: int, programs: int
) -> None:
    """Every rank ends with the residual stream plus the sum over ranks (in place) and its RMSNorm, as
    ``reference.rms_norm(all_reduce(x), weight, eps, residual)`` gives, rows split into the ranks' halves."""
    from kernels import reference

    torch.manual_seed(rows * hidden)
    parts = [torch.randn(rows, hidden) for _ in range(world)]
    residual, weight, eps = torch.randn(rows, hidden), torch.rand(hidden) + 0.5, 1e-5
    want_out, want_residual = reference.rms_norm(
        torch.stack(parts).sum(0), weight, eps, residual.clone()
    )
    memory, staged, stride = _side_by_side(parts, 64)
    residuals = [residual.clone() for _ in range(world)]
    outs = [torch.full((rows, hidden), float("nan")) for _ in range(world)]
    pad = torch.zeros(2 * programs * world, dtype=torch.int32)
    for phase in (1, 2):
        for rank in range(world):
            deltas = tuple((r - rank) * stride for r in range(world))
            all_reduce.all_reduce_rms_norm_staged(
                staged[rank],
                residuals[rank],
                weight,
                eps,
                pad,
                deltas,
                (0,) * world,
                rank,
                programs,
                sync=False,
                phase=phase,
                out=outs[rank],
            )
    for rank in range(world):
        torch.testing.assert_close(residuals[rank], want_residual, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(outs[rank], want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world,numel,programs", [(2, 1000, 3), (4, 1234, 2)])
def test_the_one_barrier_one_shot_sums_on_every_rank_and_touches_only_its_channel(
    world: int, numel: int, programs: int
) -> None:
    """The engine's schedule: every rank sums every rank's copy itself; its barrier's slots are those of
    ``channel`` (2 + the exchange), so the pad has room for no more than that channel."""
    torch.manual_seed(numel)
    parts = [torch.randn(numel) * (r + 1) for r in range(world)]
    _, staged, stride = _side_by_side(parts, 48)
    channel = 3
    pad = torch.zeros((channel + 1) * programs * world, dtype=torch.int32)
    for rank in range(world):
        out = torch.full_like(parts[0], float("nan"))
        all_reduce.all_reduce_staged(
            staged[rank],
            out,
            pad,
            tuple((r - rank) * stride for r in range(world)),
            (0,) * world,
            rank,
            programs,
            two_shot=False,
            block=64,
            sync=False,
            channel=channel,
            one_barrier=True,
        )
        torch.testing.assert_close(out, torch.stack(parts).sum(0), rtol=1e-6, atol=1e-5)
    with pytest.raises(AssertionError, match="signal pad too small"):
        all_reduce.all_reduce_staged(
            staged[0],
            torch.empty(numel),
            pad[:-1],
            tuple(r * stride for r in range(world)),
            (0,) * world,
            0,
            programs,
            two_shot=False,
            channel=channel,
            one_barrier=True,
        )
    with pytest.raises(AssertionError, match="second barrier"):
        all_reduce.all_reduce_staged(
            staged[0], torch.empty(numel), pad, (0,) * world, (0,) * world, 0, programs,
            two_shot=True, one_barrier=True,
        )  # fmt: skip


@pytest.mark.parametrize("world,rows,hidden,programs", [(2, 5, 48, 2), (4, 7, 40, 3)])
def test_the_one_barrier_fused_norm_gives_every_rank_every_rows_sum_and_norm(
    world: int, rows: int, hidden: int, programs: int
) -> None:
    """Each rank, alone (no peer writes into its buffer), ends with ``reference.rms_norm(sum, weight, eps,
    residual)`` for all rows, and the peers' buffers are only read."""
    from kernels import reference

    torch.manual_seed(rows * hidden + world)
    parts = [torch.randn(rows, hidden) for _ in range(world)]
    residual, weight, eps = torch.randn(rows, hidden), torch.rand(hidden) + 0.5, 1e-5
    want_out, want_residual = reference.rms_norm(
        torch.stack(parts).sum(0), weight, eps, residual.clone()
    )
    memory, staged, stride = _side_by_side(parts, 64)
    before = memory.clone()
    pad = torch.zeros((2 + 1) * programs * world, dtype=torch.int32)
    for rank in range(world):
        res = residual.clone()
        out, res = all_reduce.all_reduce_rms_norm_staged(
            staged[rank],
            res,
            weight,
            eps,
            pad,
            tuple((r - rank) * stride for r in range(world)),
            (0,) * world,
            rank,
            programs,
            sync=False,
            channel=2,
            one_barrier=True,
        )
        torch.testing.assert_close(res, want_residual, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(memory, before), "a one-shot rank writes nothing into the buffers"


def test_the_driver_signal_is_set_by_each_other_rank_and_taken_back_by_rank_0() -> None:
    """Three ranks' pads side by side: ranks 1 and 2 each set their slot in rank 0's pad (and nothing else);
    rank 0, which would wait for both, finds them and leaves its pad at 0 again."""
    world, width = 3, 8
    pads = torch.zeros(world * width, dtype=torch.int32)
    for rank in (1, 2):
        deltas = tuple((r - rank) * width for r in range(world))
        all_reduce.signal_driver(pads[rank * width : (rank + 1) * width], deltas, rank)
    assert pads[:width].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert not pads[width:].any()
    all_reduce.signal_driver(pads[:width], tuple(r * width for r in range(world)), 0)
    assert not pads.any()
