"""benchmarks/kernel/persistent_chain.py: the persistent chain kernel computes what the chain of matmuls computes.

On a machine without CUDA the kernel runs in Triton's CPU interpreter, which runs programs one after another: a
grid-wide barrier over several programs would wait forever there, so the CPU runs the kernel with one program
(``programs=1``), which then takes every task of every phase and passes each barrier alone. The phases' work
split, the split-K partials and their merge, the SiLU-and-mul, the counters' re-arming and the buffers' reuse
across layers are all exercised; the barrier's wait across programs is the GPU's part (the benchmark checks its
output against the same reference on the device before it times anything). float16: the interpreter's bfloat16
``tl.dot`` is wrong (tests/kernels/test_skinny_gemm.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from benchmarks.kernel.persistent_chain import (  # noqa: E402
    Chain,
    PersistentChain,
    reference_chain,
)
from kernels.persistent_decode import PersistentConfig  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DIMS = (
    128,
    128,
    192,
    256,
)  # hidden, q width, qkv width, intermediate (q narrower than qkv, as with GQA)
SMALL = dict(block_n=32, block_k=32, programs=1 if DEVICE.type == "cpu" else 0)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(
    "splits",
    [(1, 1, 1, 1), (2, 4, 2, 8), (4, 2, 1, 4)],
    ids=["no-split", "split-everywhere", "engine-like"],
)
def test_the_chain_equals_the_reference(rows: int, splits: tuple[int, int, int, int]) -> None:
    chain = Chain.random(2, DEVICE, dims=DIMS, dtype=torch.float16, seed=rows)
    x = torch.randn(rows, DIMS[0], generator=torch.Generator().manual_seed(7)).half().to(DEVICE)
    run = PersistentChain(chain, rows, PersistentConfig(*splits, **SMALL))
    run.load(x)
    run.run()
    want = reference_chain(chain, x)
    assert relative_error(run.output(), want) < 2e-3
    # the counters are re-armed for the next launch (the barrier's, the exits', every column block's)
    assert not run.counter.any()
    # a second launch from the same input gives the same output (nothing carried over), bit for bit
    first = run.output()
    run.load(x)
    run.run()
    assert torch.equal(run.output(), first)


def test_a_wrong_input_changes_the_output() -> None:
    """The check above can fail: the chain's output depends on its input."""
    chain = Chain.random(1, DEVICE, dims=DIMS, dtype=torch.float16)
    run = PersistentChain(chain, 1, PersistentConfig(**SMALL))
    x = torch.randn(1, DIMS[0]).half().to(DEVICE)
    run.load(x)
    run.run()
    assert relative_error(run.output(), reference_chain(chain, -x)) > 0.5


@pytest.mark.parametrize(
    "config, message",
    [
        (PersistentConfig(qkv_splits=3, block_k=32), "qkv_splits"),
        (PersistentConfig(down_splits=0, block_k=32), "down_splits"),
        (PersistentConfig(block_n=96, block_k=32), "blocks of 96"),
    ],
)
def test_a_config_that_does_not_tile_is_refused(config: PersistentConfig, message: str) -> None:
    chain = Chain.random(1, DEVICE, dims=DIMS, dtype=torch.float16)
    with pytest.raises(ValueError, match=message):
        PersistentChain(chain, 1, config)


def test_rows_and_dims_are_checked() -> None:
    chain = Chain.random(1, DEVICE, dims=DIMS, dtype=torch.float16)
    with pytest.raises(ValueError, match="rows"):
        PersistentChain(chain, 17, PersistentConfig(**SMALL))
    with pytest.raises(ValueError, match="q width"):
        Chain.random(1, DEVICE, dims=(128, 256, 192, 256))
