"""Drive a `CausalLM` through prefill and decode steps with a real paged KV cache: what the
oracle tests (and anyone checking a new model family) need without the full runner."""

from __future__ import annotations

import torch

from tandem.contexts import ForwardContext, set_forward_context
from tandem.models.base import CausalLM
from tandem.worker.step_inputs import ScheduledChunk, build_step_inputs
from tandem.worker.kv_cache import BlockAllocator, allocate_kv_caches, blocks_needed


class GreedyHarness:
    """One or more sequences of one model, each with its own KV blocks."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), num_blocks, block_size))

    @torch.no_grad()
    def step(self, sequences: list[dict]) -> torch.Tensor:
        """Each sequence dict holds `tokens` (all so far) and `computed` (tokens cached);
        runs their uncached tokens as one batch; returns the logits of every new token,
        `[sum(new), vocab]`, and marks them cached."""
        chunks = []
        for seq in sequences:
            seq.setdefault("blocks", [])
            need = blocks_needed(len(seq["tokens"]), self.block_size) - len(seq["blocks"])
            if need > 0:
                seq["blocks"] += self.allocator.allocate(need)
            chunks.append(ScheduledChunk(seq["tokens"][seq["computed"] :], seq["computed"], seq["blocks"]))
        inputs = build_step_inputs(chunks, self.block_size)
        with set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            hidden = self.model(inputs.input_ids, inputs.positions)
        for seq in sequences:
            seq["computed"] = len(seq["tokens"])
        return self.model.compute_logits(hidden)
