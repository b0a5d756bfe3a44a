"""`FutureMap`: placeholders for next-token ids that the running forward has not sampled yet.

In the overlapped loop the scheduler plans step N+1 while step N still runs, so a request
decoding in both steps needs, as input of N+1, the token N is about to sample. The
scheduler reserves a slot of a ring buffer for every token step N will sample and writes
`placeholder(slot) = -(slot + 1)` (negative, so never a real id) into N+1's inputs; the
forward worker stores N's sampled tokens into their slots and, at the start of N+1,
replaces every negative id by its slot's content. The worker runs steps strictly in
order, so a slot is always written before it is read.

Slot reservation happens on the scheduler thread and the buffer is only touched by the
forward worker; the ring is large enough that a slot is not reused while a step that
reads it can still be pending (the pipeline is one step deep).
"""

from __future__ import annotations

import torch

from tandem.platform.device import to_device_async


def placeholder(slot: int) -> int:
    return -(slot + 1)


class FutureMap:
    def __init__(self, max_tokens_per_step: int, device: torch.device | str = "cpu"):
        if max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        # Two steps' worth of slots can be live (N running, N+1 planned), plus one spare step.
        self.capacity = 3 * max_tokens_per_step
        self.max_tokens_per_step = max_tokens_per_step
        self.buffer = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self._next = 0

    def reserve(self, count: int) -> list[int]:
        """Slots for the `count` tokens one step will sample (scheduler thread)."""
        if count > self.max_tokens_per_step:
            raise ValueError(f"a step samples {count} tokens, over the FutureMap's {self.max_tokens_per_step}")
        slots = [(self._next + i) % self.capacity for i in range(count)]
        self._next = (self._next + count) % self.capacity
        return slots

    def store(self, slots: list[int], tokens: list[int] | torch.Tensor) -> None:
        """Publish a step's sampled tokens (forward worker); a tensor of tokens stays on the
        device (no host read)."""
        if not slots:
            return
        device = self.buffer.device
        values = tokens if isinstance(tokens, torch.Tensor) else to_device_async(torch.tensor(tokens, dtype=torch.int64), device)
        index = to_device_async(torch.tensor(slots, dtype=torch.int64), device)
        self.buffer.index_copy_(0, index, values.to(torch.int64))

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with every placeholder replaced by its token (forward worker)."""
        slots = (-input_ids - 1).clamp(min=0, max=self.capacity - 1)
        return torch.where(input_ids < 0, self.buffer[slots], input_ids)


__all__ = ["FutureMap", "placeholder"]
