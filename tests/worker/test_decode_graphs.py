"""Decode graphs (gpu-review-3 G1, G2): `--graph-mode auto` is full graphs on CUDA when the
MoE backends can be captured; a decode step pads to the next captured size, and an engine
under full graphs captures every size up to `--max-num-seqs` at start-up, largest first, so
serving batches of any size captures nothing."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.ubatch_wrapper import GRAPH_SIZES, graph_size, graph_sizes, resolve_graph_mode


def test_a_decode_step_pads_to_the_next_captured_size():
    assert graph_sizes(512) == GRAPH_SIZES
    assert graph_sizes(100)[-1] == 100 and max(graph_sizes(100)[:-1]) < 100
    assert [graph_size(n, 512) for n in (1, 3, 5, 17, 33, 65, 500)] == [1, 4, 8, 24, 48, 96, 512]
    assert graph_size(513, 512) is None
    for n in range(1, 513):
        padding = graph_size(n, 512) - n
        assert padding <= 7 if n <= 32 else padding < n / 2, n


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _config(graph_mode: str):
    from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig, SchedulerConfig

    # The masked torch experts behind torch_a2a_ll: the capturable pair that runs on the CPU.
    return EngineConfig(
        cache=CacheConfig(num_kv_blocks=96, block_size=4),
        scheduler=SchedulerConfig(max_num_seqs=6, overlap_schedule=False),
        overlap=OverlapConfig(graph_mode=graph_mode),
        parallel=ParallelConfig(all2all_backend="torch_a2a_ll", moe_backend="torch"),
        max_num_batched_tokens=64,
        device="cpu",
    )


def test_graphs_are_captured_at_start_up_and_serving_captures_none(one_rank_group):
    from tandem.engine.build import build_engine
    from tandem.engine.core import run_to_completion
    from tandem.worker.sampling import SamplingParams

    # Five requests of different lengths: the decode batch shrinks 5, 4, 3, 2, 1.
    prompts = [(i, [3 + i, 7, 11 + 2 * i][: 1 + i % 3], SamplingParams(max_tokens=3 + 2 * i, temperature=0)) for i in range(5)]
    tokens = {}
    for mode in ("none", "full"):
        engine = build_engine(_config(mode))
        try:
            wrapper = engine.runner.wrapper
            if mode == "full":
                # max_num_seqs 6 pads to 8: sizes 8, 4, 2, 1, captured before any request.
                assert sorted(key[0] for key in wrapper.graphs) == [1, 2, 4, 8]
                captured = wrapper.graph_captures
            tokens[mode] = [c.token_ids for c in run_to_completion(engine, prompts)]
            if mode == "full":
                assert wrapper.graph_captures == captured, "serving captured a graph"
                assert wrapper.graph_replays >= 5
        finally:
            engine.close()
    assert tokens["full"] == tokens["none"]
    assert [len(t) for t in tokens["full"]] == [3, 5, 7, 9, 11]


def test_auto_is_full_graphs_on_cuda_only_where_the_moe_backends_can_be_captured(one_rank_group):
    from tandem.modular_kernels import MoEConfig
    from tandem.models.tiny_moe import build_tiny_moe

    standard = build_tiny_moe(MoEConfig()).model  # local dispatch, standard torch experts (nonzero)
    masked = build_tiny_moe(MoEConfig(all2all_backend="torch_a2a_ll", group=one_rank_group, dispatch_max_tokens_per_rank=16)).model
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_graph_mode("auto", cuda, masked, compiled=False) == "full"
    assert resolve_graph_mode("auto", cuda, standard, compiled=False) == "none"
    assert resolve_graph_mode("auto", cuda, masked, compiled=True) == "none"
    assert resolve_graph_mode("auto", cpu, masked, compiled=False) == "none"
    assert resolve_graph_mode("none", cuda, masked, compiled=False) == "none"
    assert resolve_graph_mode("full", cpu, masked, compiled=False) == "full"


def test_the_runner_holds_the_resolved_mode():
    from tandem.config import EngineConfig
    from tandem.worker.build import build_runner

    runner = build_runner(EngineConfig(device="cpu"))
    assert EngineConfig().overlap.graph_mode == "auto" and runner.wrapper.graph_mode == "none"
