"""Linear and Embedding without random initialisation: every weight comes from the loader (which fails on
any tensor left unset), so initialising 100M+ parameters first would only cost seconds at start.

Their tensor-parallel forms (engine/distributed/parallel_state.py): a column-parallel layer holds this rank's slice of the
outputs, a row-parallel layer this rank's slice of the inputs and adds the ranks' partial outputs with one
all-reduce (its bias once, after the sum), and the vocabulary-parallel embedding this rank's rows of the
table. With one rank each is the plain layer. Each all-reduce names its call site's exchange (the embedding 0,
attention's output 1, the MLP's 2; engine/distributed/peer_memory.py says why consecutive sums must not share one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import parallel_state
from kernels import ops as kernel_ops
from kernels.skinny_choice import GEMM, prefer_skinny


EMBEDDING_EXCHANGE, ATTENTION_EXCHANGE, MLP_EXCHANGE = 0, 1, 2


def matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (into ``out``): a decode step's few rows through the skinny kernel where it measured
    faster than cuBLAS (kernels/skinny_choice.py), else through torch (cuBLAS)."""
    if prefer_skinny(GEMM, x, weight):
        return kernel_ops.skinny_gemm(x, weight, out)
    return torch.matmul(x, weight.t(), out=out)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and prefer_skinny(GEMM, x, self.weight):
            return kernel_ops.skinny_gemm(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def store_weight_column_major(self) -> None:
        """Keep the [out, in] weight in [in, out] memory order. F.linear then hands MKL a plain (not
        transposed) right operand, which it reads markedly faster for the few-row inputs of decoding on
        the CPU (measured: docs/BENCHMARKS.md). Values are unchanged; only strides differ."""
        self.weight.data = self.weight.data.t().contiguous().t()


class ColumnParallelLinear(Linear):
    """``out_features`` are this rank's outputs (the loader fills them with its rows of the full weight)."""


class RowParallelLinear(Linear):
    """``in_features`` are this rank's slice of the inputs; the output is the full sum over ranks, through
    ``exchange`` (ATTENTION_EXCHANGE or MLP_EXCHANGE)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, exchange: int) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.exchange = exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel_state.current().size == 1:
            return super().forward(x)
        out = parallel_state.linear_all_reduce(x, self.weight, self.exchange)
        return out if self.bias is None else out.add_(self.bias)


def project_then_norm(
    proj: nn.Module, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(proj(x), residual)``: an RMSNorm after a row-parallel projection. Under tensor parallelism, where
    our peer kernel sums the projection, the sum, the residual add and the norm happen in that one kernel (the
    same arithmetic as the norm kernel); everywhere else the two layers run one after the other."""
    if (
        isinstance(proj, RowParallelLinear)
        and proj.bias is None
        and parallel_state.current().size > 1
    ):
        fused = parallel_state.linear_all_reduce_rms_norm(
            x, proj.weight, norm.weight, norm.eps, residual, proj.exchange
        )
        if fused is not None:
            return fused
    return norm(proj(x), residual)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class VocabParallelEmbedding(Embedding):
    """Rows ``start .. start + num_embeddings - 1`` of the table (the last rank's slice padded with zero rows
    when the ranks do not divide the vocabulary); a token outside them looks up zeros here, so the all-reduce
    of the ranks' lookups is exactly its row."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        tp = parallel_state.current()
        shard = -(-vocab_size // tp.size)
        super().__init__(shard, hidden_size)
        self.vocab_size = vocab_size
        self.start = tp.rank * shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.current().size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel_state.all_reduce(
            out.masked_fill_(outside.unsqueeze(-1), 0), EMBEDDING_EXCHANGE
        )
