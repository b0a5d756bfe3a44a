"""Dynamic chunking: the quadratic latency fit and the chunk sizes it gives; every chunk of a
growing prefix costs what the base chunk costs from an empty one."""

from __future__ import annotations

import pytest

from tandem.models.tiny_moe import build_tiny_moe
from tandem.engine.chunking import DynamicChunker, fit_chunker, fit_quadratic
from tandem.config import SchedulerConfig
from tandem.engine.core import Engine
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams


def test_fit_recovers_a_quadratic():
    a, b, c = fit_quadratic([100, 200, 400, 800], [2e-6 * n * n + 1e-3 * n + 0.5 for n in (100, 200, 400, 800)])
    assert a == pytest.approx(2e-6) and b == pytest.approx(1e-3) and c == pytest.approx(0.5)
    with pytest.raises(ValueError, match="three or more"):
        fit_quadratic([1, 1, 2], [0.1, 0.1, 0.2])


def test_chunks_shrink_as_the_prefix_grows_and_keep_the_base_cost():
    chunker = DynamicChunker(a=1e-6, b=1e-3, c=0.0, base=1024, granularity=16, min_chunk=64)
    f = lambda n: 1e-6 * n * n + 1e-3 * n  # noqa: E731
    assert chunker(0) == 1024
    sizes = [chunker(prefix) for prefix in (0, 1024, 4096, 8192)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 1024
    for prefix, size in zip((1024, 4096, 8192), sizes[1:]):
        assert size % 16 == 0
        assert f(prefix + size) - f(prefix) <= f(1024) - f(0) < f(prefix + size + 16) - f(prefix)
    assert DynamicChunker(a=-1e-9, b=1e-3, c=0, base=512)(10_000) == 512  # no quadratic growth: fixed
    assert DynamicChunker(a=1.0, b=0, c=0, base=512, min_chunk=32)(10**9) == 32


def test_an_engine_with_a_fitted_chunker_gives_the_same_tokens():
    info = build_tiny_moe()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = list(range(1, 200))
    tokens = []
    for dynamic in (False, True):
        runner = ModelRunner(info, num_kv_blocks=64, block_size=16)
        engine = Engine(runner, SchedulerConfig(overlap_schedule=False), max_num_batched_tokens=64)
        if dynamic:
            engine.scheduler.chunk_limit = fit_chunker(runner, 64)
            assert engine.scheduler.chunk_limit(0) <= 64
        engine.add_request("r", prompt, params)
        out = []
        while engine.has_work:
            out += [t for o in engine.step() for t in o.new_token_ids]
        tokens.append(out)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
