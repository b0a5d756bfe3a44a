"""Which decoder layers a pipeline stage holds, and building a model with only those.

Even by default: every stage gets `L // P` layers and the remainder goes one each to the
stages before the last, latest first (the last stage also runs the final norm and the LM
head, so it gets no extra layer). `--pp-layer-partition 10,14` sets the counts explicitly.
The first stage also holds the embedding, the last the final norm and the LM head (and the
embedding when the head is tied to it); every other module of a non-owned layer is a
`MissingLayer` with no parameters, so its checkpoint tensors are never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def partition_layers(num_layers: int, num_stages: int, partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """`[start, end)` of every stage."""
    if num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {num_stages}")
    if partition is not None:
        counts = [int(c) for c in partition]
        if len(counts) != num_stages:
            raise ValueError(f"--pp-layer-partition has {len(counts)} entries for {num_stages} pipeline stages")
        if any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"--pp-layer-partition {','.join(map(str, counts))} must give every stage at least one layer "
                f"and sum to the model's {num_layers} layers"
            )
    else:
        if num_layers < num_stages:
            raise ValueError(f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages")
        counts = [num_layers // num_stages] * num_stages
        for i in range(num_layers % num_stages):
            counts[-2 - i if num_stages > 1 else 0] += 1
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


@dataclass(frozen=True)
class StageLayers:
    """The layers `[start, end)` one stage runs; `is_first` / `is_last` say whether it also
    runs the embedding / the final norm and LM head."""

    start: int
    end: int
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> "StageLayers":
        return cls(0, num_layers, True, True)

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def owns_embedding(self, tied: bool) -> bool:
        return self.is_first or (self.is_last and tied)

    def owns_checkpoint_tensor(self, name: str, *, tied: bool) -> bool:
        """Whether this stage needs checkpoint tensor `name` (HF naming)."""
        match = _LAYER.match(name)
        if match:
            return self.owns(int(match[1]))
        if name.startswith("model.embed_tokens."):
            return self.owns_embedding(tied)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True


def stage_layers(num_layers: int, stage: int, num_stages: int, partition: Sequence[int] | None = None) -> StageLayers:
    start, end = partition_layers(num_layers, num_stages, partition)[stage]
    return StageLayers(start, end, stage == 0, stage == num_stages - 1)


class MissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


def build_layers(num_layers: int, build: Callable[[int], nn.Module], stage: StageLayers | None) -> nn.ModuleList:
    """`build(i)` for the stage's layers, `MissingLayer` for the others (indices are kept)."""
    stage = stage or StageLayers.whole(num_layers)
    return nn.ModuleList(build(i) if stage.owns(i) else MissingLayer() for i in range(num_layers))


__all__ = ["MissingLayer", "StageLayers", "build_layers", "partition_layers", "stage_layers"]
