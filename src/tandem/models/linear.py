"""`Linear`: the models' dense projection, `nn.Linear` with its CPU GEMM on a weight packed
once for oneDNN (`tandem.platform.cpu_gemm`: MKL repacks it on every call, which dominates a
decode step's few rows). Other devices run `F.linear` as before."""

from __future__ import annotations

import torch
from torch import nn

from tandem.platform.cpu_gemm import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


__all__ = ["Linear"]
