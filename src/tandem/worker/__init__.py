"""One step of one rank: the model runner (plan -> run -> sample), the ubatch wrapper, step
inputs, the sampler and grammar masks, the KV cache, the future map."""

from tandem.worker.step_inputs import ScheduledChunk, StepInputs, build_step_inputs
from tandem.worker.kv_cache import BlockAllocator, OutOfBlocksError, allocate_kv_caches, blocks_needed

__all__ = [
    "BlockAllocator",
    "OutOfBlocksError",
    "ScheduledChunk",
    "StepInputs",
    "allocate_kv_caches",
    "blocks_needed",
    "build_step_inputs",
]
