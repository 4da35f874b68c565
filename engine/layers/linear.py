"""Linear and Embedding without random initialisation: every weight comes from the loader (which fails on
any tensor left unset), so initialising 100M+ parameters first would only cost seconds at start."""
from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass

    def store_weight_column_major(self) -> None:
        """Keep the [out, in] weight in [in, out] memory order. F.linear then hands MKL a plain (not
        transposed) right operand, which it reads markedly faster for the few-row inputs of decoding on
        the CPU (measured: docs/BENCHMARKS.md). Values are unchanged; only strides differ."""
        self.weight.data = self.weight.data.t().contiguous().t()


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass
