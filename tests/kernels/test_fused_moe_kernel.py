"""kernels/fused_moe.py (the mixture-of-experts MLP: align, gate/up + SiLU-and-mul, down + routing weight, sum
over the K experts of a token) against kernels/reference.py's loop over experts in float32.

Without CUDA the kernels run in Triton's interpreter at a tiny layer (H = 64, I = 32, E = 4 or 8): float32 must
match the reference to 1e-5 (the dots are exact fp32 there), half types to 1e-2 (the activation and each
expert's output are rounded to the input dtype). Inputs are random, never zeros, and every float buffer the
kernel allocates starts as NaN (``poisoned_empty``), so a row left unwritten, or one read that should not be,
shows. Experts that no token chose hold NaN weights: reading them would show too.

The align step is checked on its own invariants, computed from the ids by hand (bincount), not from its output:
each pair exactly once, in a block of its expert, each expert with as many blocks as its pairs need and no more,
every other row the padding sentinel ``T * K`` that the kernels mask. It has two ways to rank the pairs (in
registers up to ``REGISTER_PAIRS`` pairs, atomic counters beyond): the tests run both at these small sizes.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
import kernels.fused_moe as fused_moe_module  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.counters import zeroed_counters  # noqa: E402
from kernels.fused_moe import (  # noqa: E402
    DECODE,
    MAX_EXPERTS,
    MIDDLE,
    PREFILL,
    MoeConfig,
    Tile,
    choose_config,
    fused_moe,
    max_rows,
    moe_align,
)
from tests.interpreter_rounding import round_bfloat16_like_gpu  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HIDDEN, INTER = 64, 32
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


@pytest.fixture
def bfloat16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter keeps bfloat16 tiles as their bit patterns (numpy has no bfloat16) and its dot would
    multiply those as integers: dots get the values (in float32), and float32 -> bfloat16 rounds to nearest
    even as a GPU does."""
    if DEVICE.type == "cuda":
        return
    from triton.runtime import interpreter

    round_bfloat16_like_gpu(monkeypatch)
    convert, create_dot = interpreter._convert_float, interpreter.InterpreterBuilder.create_dot

    def as_float32(tile):
        if tile.dtype != tl.bfloat16:
            return tile
        values = convert(tile.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def dot_on_values(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(
            self, as_float32(a), as_float32(b), d, input_precision, max_num_imprecise_acc
        )

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot_on_values)


@pytest.fixture(params=["registers", "atomics"])
def align_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The align step's two ways to rank pairs, each forced by the threshold (these tests use < 128 pairs)."""
    threshold = 128 if request.param == "registers" else 0
    monkeypatch.setattr(fused_moe_module, "REGISTER_PAIRS", threshold)
    return request.param


def layer(
    experts: int, dtype: torch.dtype, seed: int, hidden: int = HIDDEN, inter: int = INTER
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (w_gate_up [E, 2I, H], w_down [E, H, I]) scaled like a trained layer (outputs of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w_gate_up.to(DEVICE, dtype), w_down.to(DEVICE, dtype)


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of the router on random logits: K distinct experts per token, weights summing to 1."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    weights, ids = reference.route(logits, top_k)
    return weights.to(DEVICE), ids.to(DEVICE)


def hidden_states(tokens: int, dtype: torch.dtype, seed: int, size: int = HIDDEN) -> torch.Tensor:
    return torch.randn(tokens, size, generator=torch.Generator().manual_seed(seed)).to(
        DEVICE, dtype
    )


def unchosen_poisoned(w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor) -> None:
    """NaN into the weights of every expert no token chose: the kernel must not read them."""
    unused = torch.ones(w_gate_up.shape[0], dtype=torch.bool, device=ids.device)
    unused[ids.long().flatten()] = False
    w_gate_up[unused] = float("nan")
    w_down[unused] = float("nan")


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected.double()).norm() / expected.double().norm())


def check_against_reference(hidden, w_gate_up, w_down, weights, ids, config=None) -> None:
    out = fused_moe(hidden, w_gate_up, w_down, weights, ids, config)
    expected = reference.fused_moe(hidden.float(), w_gate_up, w_down, weights, ids)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert relative_error(out, expected) < TOLERANCE[hidden.dtype]


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_moe_matches_the_reference_in_float32(tokens, top_k, experts):
    w_gate_up, w_down = layer(experts, torch.float32, seed=tokens)
    weights, ids = routed(tokens, experts, top_k, seed=tokens + experts)
    unchosen_poisoned(w_gate_up, w_down, ids)
    check_against_reference(
        hidden_states(tokens, torch.float32, 7), w_gate_up, w_down, weights, ids
    )


@pytest.mark.parametrize("top_k", [1, 2])
def test_an_expert_with_every_token_and_one_with_none(top_k, align_path):
    """Expert 2 gets every token (several blocks of rows), expert 1 none (no block: NaN weights unread)."""
    tokens, experts = 33, 4
    ids = torch.full((tokens, top_k), 2, dtype=torch.int64)
    if top_k == 2:
        ids[:, 1] = torch.tensor([0, 3])[torch.arange(tokens) % 2]
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(3)) + 0.1
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    w_gate_up, w_down = layer(experts, torch.float32, seed=11)
    unchosen_poisoned(w_gate_up, w_down, ids)
    blocks = moe_align(ids, experts, 16).block_experts.tolist()
    assert blocks.count(2) == math.ceil(tokens / 16) and 1 not in blocks
    check_against_reference(
        hidden_states(tokens, torch.float32, 5), w_gate_up, w_down, weights, ids
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_matches_the_float32_reference(dtype, bfloat16_dots):
    w_gate_up, w_down = layer(8, dtype, seed=1)
    weights, ids = routed(33, 8, 2, seed=2)
    check_against_reference(hidden_states(33, dtype, 3), w_gate_up, w_down, weights, ids)


RAGGED = MoeConfig(
    block_m=16, gate_up=Tile(block_n=32, block_k=32), down=Tile(block_n=32, block_k=32)
)


@pytest.mark.parametrize(
    "config", [DECODE, MIDDLE, PREFILL, RAGGED], ids=["decode", "middle", "prefill", "ragged"]
)
def test_every_config_computes_the_same_function(config):
    """H = 80, I = 48: the 32-wide column and reduction tiles of RAGGED end half outside the weights (masked);
    the wider tiles of the others end further outside."""
    hidden, inter, experts, tokens = 80, 48, 8, 20
    w_gate_up, w_down = layer(experts, torch.float32, seed=4, hidden=hidden, inter=inter)
    weights, ids = routed(tokens, experts, 2, seed=5)
    x = hidden_states(tokens, torch.float32, 6, size=hidden)
    check_against_reference(x, w_gate_up, w_down, weights, ids, config)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_align_puts_each_pair_once_in_a_block_of_its_expert(
    tokens, top_k, experts, block_m, align_path
):
    _, ids = routed(tokens, experts, top_k, seed=tokens * experts + top_k)
    align = moe_align(ids, experts, block_m)
    flat, num_pairs = ids.flatten().long().cpu(), tokens * top_k
    rows = align.sorted_pairs.cpu().long().view(-1, block_m)
    blocks = align.block_experts.cpu().long()
    assert (
        align.sorted_pairs.numel() == max_rows(num_pairs, experts, block_m) == len(blocks) * block_m
    )
    real = rows < num_pairs
    assert sorted(rows[real].tolist()) == list(range(num_pairs))  # each pair once
    assert (
        (rows == num_pairs) | real
    ).all()  # every other row is the sentinel, masked by the kernels
    per_row_expert = blocks[:, None].expand_as(rows)
    assert (flat[rows[real]] == per_row_expert[real]).all()  # a pair sits in a block of its expert
    needed = [math.ceil(n / block_m) for n in torch.bincount(flat, minlength=experts).tolist()]
    assert [int((blocks == e).sum()) for e in range(experts)] == needed  # no expert without pairs
    used = blocks < experts
    assert (blocks[used].diff() >= 0).all() and not used[
        int(used.sum()) :
    ].any()  # runs, then unused
    assert (blocks[~used] == experts).all() and not real[~used].any()


def test_counters_are_rearmed_after_calls_of_any_size(align_path):
    """The align counts and the per-token sums' counters are zero again after each call, whatever E and T:
    the next call, or a CUDA graph's replay, finds them ready (a call with fewer experts once read the rows a
    call with more had left)."""
    for tokens, experts in ((33, 8), (5, 4), (12, 8)):
        w_gate_up, w_down = layer(experts, torch.float32, seed=tokens)
        weights, ids = routed(tokens, experts, 2, seed=experts)
        x = hidden_states(tokens, torch.float32, 1)
        check_against_reference(x, w_gate_up, w_down, weights, ids)
        assert not zeroed_counters("fused_moe_align", DEVICE, 1)[:MAX_EXPERTS].any()
        assert not zeroed_counters("fused_moe", DEVICE, 1).any()


def test_route_takes_the_k_most_probable_experts_renormalised():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.4, 0.05, 0.3, 0.25]])
    weights, ids = reference.route(probs.log(), 2)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[2 / 3, 1 / 3], [4 / 7, 3 / 7]]))
    plain, _ = reference.route(probs.log(), 2, renormalize=False)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.25], [0.4, 0.3]]))


def test_the_heuristic_grows_the_blocks_with_the_tokens_per_expert():
    """Qwen3-30B-A3B (E = 128, K = 8): decode batches get 16-row blocks, prefill 64."""
    picks = {
        tokens: choose_config(tokens * 8, 128, 2048, 768).block_m for tokens in (1, 16, 256, 2048)
    }
    assert picks == {1: 16, 16: 16, 256: 32, 2048: 64}


def test_ops_dispatch_reaches_fused_moe():
    w_gate_up, w_down = layer(4, torch.float32, seed=8)
    weights, ids = routed(3, 4, 2, seed=9)
    x = hidden_states(3, torch.float32, 10)
    out = kernels.ops.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert relative_error(out, reference.fused_moe(x, w_gate_up, w_down, weights, ids)) < 1e-5


def test_no_tokens_gives_an_empty_output():
    w_gate_up, w_down = layer(4, torch.float32, seed=12)
    weights, ids = routed(0, 4, 2, seed=13)
    assert fused_moe(hidden_states(0, torch.float32, 1), w_gate_up, w_down, weights, ids).shape == (
        0,
        HIDDEN,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w_down=torch.zeros(4, HIDDEN, 16)), "do not fit"),
        (dict(topk_ids=torch.zeros(3, 2)), "int32 or int64"),
        (dict(w_gate_up=torch.zeros(4, 2 * INTER, HIDDEN, dtype=torch.float16)), "weights must be"),
        (dict(topk_weights=torch.zeros(3, 1)), r"\[3, K\]"),
    ],
    ids=["down shape", "id dtype", "weight dtype", "weights shape"],
)
def test_malformed_arguments_are_refused(change, message):
    args = dict(
        hidden=torch.ones(3, HIDDEN),
        w_gate_up=torch.ones(4, 2 * INTER, HIDDEN),
        w_down=torch.ones(4, HIDDEN, INTER),
        topk_weights=torch.ones(3, 2),
        topk_ids=torch.zeros(3, 2, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=message):
        fused_moe(**{**args, **change})
