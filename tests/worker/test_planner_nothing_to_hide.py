"""`--overlap-policy auto` where nothing moves: one rank with the `local` dispatch has no
all-to-all for DBO or SBO to hide, so the planner's only choice is no overlap; a modelled
fabric on the device (what `benchmarks/gpu.py` installs on one GPU) gives it transfers to hide
again."""

import torch

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.worker.build import build_runner
from tandem.worker.sampling import SamplingParams
from tandem.worker.step_inputs import ScheduledChunk


def _auto_runner():
    overlap = OverlapConfig(enable_dbo=True, overlap_policy="auto", dbo_decode_token_threshold=0,
                            dbo_prefill_token_threshold=0)
    config = EngineConfig(model="tiny-moe", device="cpu", overlap=overlap, parallel=ParallelConfig(enable_sbo=True),
                          cache=CacheConfig(num_kv_blocks=64, block_size=4))
    return build_runner(config)


def test_one_rank_with_local_dispatch_never_overlaps():
    runner = _auto_runner()
    assert not runner.moves_tokens
    assert [c.name for c in runner.planner.choices] == ["none"]
    params = SamplingParams(max_tokens=1)
    for lengths in ([6, 4], [1, 1, 1, 1], [9]):
        chunks = [ScheduledChunk(list(range(3, 3 + n)), 0, runner.allocator.allocate(4)) for n in lengths]
        plan = runner.plan_step(chunks)
        assert plan.num_ubatches == 1 and plan.sbo is False
        with torch.no_grad():
            runner.execute(chunks, [params] * len(lengths), [None] * len(lengths))
    assert runner.ubatched_steps == 0 and runner.planner.stats.choices == {"none": 3}


def test_a_modelled_fabric_gives_the_planner_something_to_hide():
    from tandem.modular_kernels import FabricModel
    from tandem.modular_kernels.device_fabric import install_device_fabric

    runner = _auto_runner()
    assert install_device_fabric(runner.model, FabricModel(latency_s=0.0, bytes_per_s=1e12)) > 0
    assert runner.moves_tokens
    assert [c.name for c in runner.planner.choices] == ["none", "sbo", "dbo-2"]
