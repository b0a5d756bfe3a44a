"""Paged KV cache: fixed-size blocks handed out from a free list, and the per-layer cache
tensors the attention layers read and write."""

from __future__ import annotations

import torch

from tandem.models.base import KVCacheSpec
from tandem.models.paged_attention import NULL_BLOCK


class OutOfBlocksError(RuntimeError):
    """The cache has fewer free blocks than asked for."""


class BlockAllocator:
    """Hands out cache blocks. With `reserve_null_block`, block `NULL_BLOCK` is never handed
    out: graph replays write their padding rows there (see `paged_attention`)."""

    def __init__(self, num_blocks: int, *, reserve_null_block: bool = False):
        first = NULL_BLOCK + 1 if reserve_null_block else 0
        if num_blocks - first < 1:
            raise ValueError(f"the KV cache needs at least one usable block, got {num_blocks - first}")
        self.num_blocks = num_blocks - first
        # Low ids first: pop() from the end of a reversed list.
        self._free = list(range(num_blocks - 1, first - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def allocate_kv_caches(
    specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> list[dict[str, torch.Tensor]]:
    """Zeroed cache tensors `[num_blocks, block_size, *shape]` for every attention layer."""
    return [
        {name: torch.zeros((num_blocks, block_size, *shape), dtype=spec.dtype, device=device) for name, shape in spec.shapes.items()}
        for spec in specs
    ]

