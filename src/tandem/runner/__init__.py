"""UBatchWrapper, ModelRunner, KV cache, sampling, scheduler loops, FutureMap, engine,
DP ranks and the HTTP server."""

from tandem.runner.batch import ScheduledChunk, StepInputs, build_step_inputs
from tandem.runner.kv_cache import BlockAllocator, OutOfBlocksError, allocate_kv_caches, blocks_needed

__all__ = [
    "BlockAllocator",
    "OutOfBlocksError",
    "ScheduledChunk",
    "StepInputs",
    "allocate_kv_caches",
    "blocks_needed",
    "build_step_inputs",
]
