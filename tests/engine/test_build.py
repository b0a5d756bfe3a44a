"""`build_engine(config)` is the one mapping of the config tree onto an engine: every scheduler
setting, the step token budget and dynamic chunking reach the engine it builds, whether it
builds the runner or is handed one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tandem.engine.build import build_engine
from tandem.engine.core import Engine
from tandem.worker.sampling import SamplingParams


def _config(**scheduler) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
        scheduler=SchedulerConfig(**scheduler),
        max_num_batched_tokens=24,
        device="cpu",
    )


def test_every_setting_reaches_the_engine_it_builds():
    config = _config(max_num_seqs=3, max_model_len=40, overlap_schedule=False, step_timeout_s=7.0)
    engine = build_engine(config)
    try:
        assert type(engine) is Engine and not engine.lockstep
        scheduler = engine.scheduler
        assert (scheduler.max_num_seqs, scheduler.max_model_len, scheduler.max_num_batched_tokens) == (3, 40, 24)
        assert (engine.overlap_schedule, engine.step_timeout_s, scheduler.chunk_limit) == (False, 7.0, None)
        refused = engine.add_request("long", list(range(1, 31)), SamplingParams(max_tokens=11))
        assert refused is not None and "context length 40" in refused.error
    finally:
        engine.close()


def test_a_given_runner_is_used_and_dynamic_chunking_fitted():
    config = _config(overlap_schedule=False)
    first = build_engine(config)
    chunked = replace(config, parallel=ParallelConfig(enable_dynamic_chunking=True))
    engine = build_engine(chunked, runner=first.runner)
    try:
        assert engine.runner is first.runner and engine.scheduler.chunk_limit is not None
        assert 1 <= engine.scheduler.chunk_limit(0) <= config.max_num_batched_tokens
    finally:
        engine.close()
        first.close()


def test_pipeline_stages_build_their_own_runners():
    with pytest.raises(ValueError, match="each pipeline stage's runner"):
        build_engine(replace(_config(), parallel=ParallelConfig(pipeline_parallel_size=2)), runner=object())
