"""The compiled step through the real runner (inductor, tiny-moe): greedy tokens equal eager's
under DBO (threads; greenlets are refused, tests/models/test_compiled.py), TBO, SBO and pipeline parallelism, the ubatches still yield
inside the opaque MoE op, a serving run of mixed batch sizes compiles nothing after start-up,
and a second build reads the compile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.engine.offline import build_runner, generate
from tandem.testing import run_distributed
from tandem.worker.sampling import SamplingParams

#: Compiles with inductor in each rank process: not in the fast tier.
pytestmark = pytest.mark.slow

PROMPTS = {
    0: ["The quick brown fox jumps over the lazy dog, again and again.", "Hi", "MoE"],
    1: ["A", "Expert parallelism moves tokens to experts and back"],
}


def _config(compile_mode, *, enable_dbo=False, executor="thread", enable_sbo=False):
    return EngineConfig(
        model="tiny-moe",
        compile=compile_mode,
        overlap=OverlapConfig(
            enable_dbo=enable_dbo, executor=executor, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0
        ),
        parallel=ParallelConfig(data_parallel_size=2, all2all_backend="torch_a2a", enable_sbo=enable_sbo),
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
        max_num_batched_tokens=128,
    )


def _run(rank, world, configs):
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    results = []
    for config in configs:
        runner = build_runner(config, group=dist.group.WORLD)
        tok = runner.info.tokenizer
        params = SamplingParams(max_tokens=6 if rank == 0 else 3, temperature=0, ignore_eos=True)
        prompts = [(i, tok.encode(p).ids, params) for i, p in enumerate(PROMPTS[rank])]
        if runner.compiled is not None:
            runner.warm_up()
        # Every graph dynamo compiles in this process: the model's and the decode attention's.
        compiled_before = counters["stats"]["unique_graphs"]
        completions = generate(runner, prompts)
        graphs = None if runner.compiled is None else (runner.compiled.graphs, counters["stats"]["unique_graphs"] - compiled_before)
        results.append(([c.token_ids for c in completions], runner.ubatched_steps, runner.ubatch_yields, graphs))
    return results


def test_compiled_gives_eager_tokens_under_dbo_tbo_and_sbo_without_recompiling():
    configs = [
        _config("off"),
        _config("on"),
        _config("on", enable_dbo=True, executor="thread"),
        _config("on", enable_dbo=True, executor="stages"),
        _config("on", enable_sbo=True),
    ]
    per_rank = run_distributed(_run, 2, configs, timeout_s=600)
    for rank, runs in enumerate(per_rank):
        eager_tokens = runs[0][0]
        assert [len(t) for t in eager_tokens] == ([6] * 3 if rank == 0 else [3] * 2)
        for config, (tokens, ubatched, yields, graphs) in zip(configs[1:], runs[1:]):
            what = f"rank {rank}, dbo={config.overlap.enable_dbo} {config.overlap.executor}, sbo={config.parallel.enable_sbo}"
            assert tokens == eager_tokens, what
            model_graphs, compiled_while_serving = graphs
            assert model_graphs == 2 and compiled_while_serving == 0, f"{what}: {graphs}"
            if config.overlap.enable_dbo:
                assert ubatched > 0, what
                if config.overlap.executor != "stages":
                    assert yields > 0, f"{what}: no dbo_yield ran inside the opaque MoE op"


def test_a_second_start_reads_the_compile_cache(tmp_path):
    """Two processes build the same compiled runner over one fresh cache directory: the first
    compiles and saves, the second finds every graph in the cache."""
    script = (
        "import json\n"
        "from torch._dynamo.utils import counters\n"
        "from tandem.config import CacheConfig, EngineConfig\n"
        "from tandem.engine.offline import build_runner\n"
        "config = EngineConfig(model='tiny-moe', compile='on', cache=CacheConfig(num_kv_blocks=32, block_size=4))\n"
        "runner = build_runner(config)\n"
        "runner.warm_up()\n"
        "print(json.dumps({'cache': str(runner.compiled.cache_dir), **counters['aot_autograd']}))\n"
    )
    env = {**os.environ, "TANDEM_COMPILE_CACHE": str(tmp_path)}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"] == second["cache"] and first["cache"].startswith(str(tmp_path))
    assert first.get("autograd_cache_miss", 0) >= 2 and first.get("autograd_cache_hit", 0) == 0
    assert second.get("autograd_cache_hit", 0) == first["autograd_cache_miss"] and not second.get("autograd_cache_miss")


def test_pipeline_stages_compile_and_agree_with_eager():
    def run(mode: str) -> str:
        argv = [sys.executable, "-m", "tandem", "generate", "Hello there", "MoE", "--pipeline-parallel-size", "2",
                "--max-tokens", "6", "--compile", mode]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    compiled = run("on")
    assert compiled == run("off") and compiled.strip()
