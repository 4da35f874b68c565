"""Linear and Embedding without random initialisation: every weight comes from the loader (which fails on
any tensor left unset), so initialising 100M+ parameters first would only cost seconds at start."""
from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass
