"""Everything the runner makes lives on the model's device, and a CPU run never touches
`torch.cuda` (checked here on CPU; tests/cuda checks the same on a GPU)."""

from __future__ import annotations

import dataclasses
import random

import torch

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, SchedulerConfig
from tandem.contexts import ForwardContext, get_forward_context, set_forward_context
from tandem.worker.step_inputs import ScheduledChunk, build_step_inputs
from tandem.engine.core import Engine
from tandem.engine.offline import build_runner, generate
from tandem.worker.sampling import SamplingParams
from tandem.worker.ubatch_wrapper import UBatchWrapper
from tandem.ubatch import split_by_tokens


def _config(**overlap) -> EngineConfig:
    return EngineConfig(
        overlap=OverlapConfig(dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0, **overlap),
        cache=CacheConfig(num_kv_blocks=32, block_size=4),
        max_num_batched_tokens=64,
        device="cpu",
        dtype="float32",
    )


def _forbid_cuda(monkeypatch) -> list[str]:
    """Make every torch.cuda entry point a runtime path could reach record its use."""
    calls: list[str] = []
    for name in ("Event", "Stream", "current_stream", "set_stream", "synchronize", "set_device", "graph",
                 "CUDAGraph", "current_blas_handle", "graph_pool_handle", "stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n), raising=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: calls.append("pin_memory") or self)
    return calls


def test_runner_tensors_live_on_the_model_device_and_cpu_never_calls_cuda(monkeypatch):
    calls = _forbid_cuda(monkeypatch)
    runner = build_runner(_config(enable_dbo=True))
    device = runner.device
    assert device == torch.device("cpu") and runner.platform.name == "cpu"
    assert all(p.device == device for p in runner.model.parameters())
    assert all(t.device == device for layer in runner.model.model.layers for t in layer.self_attn.kv_cache.values())

    seen = {}
    original_step_inputs = runner.step_inputs

    def spying_step_inputs(chunks, plan):
        inputs = original_step_inputs(chunks, plan)
        m = inputs.attn_metadata
        seen["step"] = [inputs.input_ids, inputs.positions, m.query_start_loc, m.seq_lens, m.slot_mapping, m.block_table]
        return inputs

    runner.step_inputs = spying_step_inputs
    tok = runner.info.tokenizer
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [(i, tok.encode(p).ids, params) for i, p in enumerate(["Hello there", "MoE", "ab", "device"])]
    completions = generate(runner, prompts)
    assert [len(c.token_ids) for c in completions] == [3] * 4
    assert all(t.device == device for t in seen["step"])
    assert runner.ubatched_steps > 0
    assert calls == [], f"a CPU run called torch.cuda / pinned memory: {calls}"


class _ReadsMetadata(torch.nn.Module):
    """A graphable decode forward that reads every metadata tensor."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, input_ids, positions):
        m = get_forward_context().attn_metadata
        return (input_ids + positions + m.seq_lens + m.block_table[:, 0] + m.slot_mapping).float() * self.scale


def test_graph_static_buffers_live_on_the_model_device(monkeypatch):
    calls = _forbid_cuda(monkeypatch)
    model = _ReadsMetadata()
    wrapper = UBatchWrapper(model, graph_mode="full", max_blocks_per_seq=4)
    assert wrapper.platform.name == "cpu"
    for step in range(2):
        inputs = build_step_inputs([ScheduledChunk([3 + step], 4, [1, 2]), ScheduledChunk([5], 1, [3])], 4, 4)
        slices = split_by_tokens([1, 1, 1, 1], 2)
        with set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata, ubatch_slices=slices)):
            out = wrapper(inputs.input_ids, inputs.positions)
    assert wrapper.graph_captures == 1 and wrapper.graph_replays == 1
    assert out[0].item() == 4 + 4 + 5 + 1 + 8  # id + position + seq_len + first block + slot, replayed
    (graph,) = wrapper.graphs.values()
    m = graph.metadata
    assert all(t.device == torch.device("cpu") for t in [*graph.inputs, m.query_start_loc, m.seq_lens, m.slot_mapping, m.block_table])
    assert calls == []


def test_engine_future_map_follows_the_runner_device_and_draws_come_from_the_host(monkeypatch):
    calls = _forbid_cuda(monkeypatch)
    runner = build_runner(_config())
    engine = Engine(runner, SchedulerConfig(max_num_seqs=4), max_num_batched_tokens=64)
    try:
        assert engine.future_map.buffer.device == runner.device
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=1.0, seed=3, ignore_eos=True))
        # The request's uniforms come from its seeded host stream, whatever the device.
        assert engine.sampling.samplers["a"].stream.getstate() == random.Random(3).getstate()
        outputs = []
        while engine.has_work:
            outputs += engine.step()
        outputs += engine.drain()
        assert sum(len(o.new_token_ids) for o in outputs) == 2
    finally:
        engine.close()
    assert calls == []


def test_float16_dtype_reaches_weights_and_cache():
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=8, block_size=4), device="cpu", dtype="bfloat16", compile="off")
    runner = build_runner(config)
    assert {p.dtype for p in runner.model.parameters()} >= {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for t in runner.model.model.layers[0].self_attn.kv_cache.values())
    result = runner.execute([ScheduledChunk([5, 6, 7], 0, runner.allocator.allocate(1))], [SamplingParams(temperature=0)], [None])
    assert isinstance(result.tokens[0], int)


def test_ubatch_split_plans_from_host_copies_without_reading_device_tensors():
    inputs = build_step_inputs([ScheduledChunk([1, 2, 3, 4, 5], 0, [1, 2]), ScheduledChunk([6, 7], 3, [3, 4])], 4, 8)
    m = inputs.attn_metadata
    assert m.query_start_loc_host == (0, 5, 7) and m.seq_lens_host == (5, 5)
    # On the meta device any host read of the tensors raises: the split must use the copies.
    on_meta = dataclasses.replace(m, query_start_loc=m.query_start_loc.to("meta"), seq_lens=m.seq_lens.to("meta"))
    slices = split_by_tokens(inputs.num_scheduled_tokens, 2, num_tokens_padded=8)
    parts = on_meta.split(slices)
    reference = m.split(slices)
    for part, ref in zip(parts, reference):
        assert part.query_start_loc.device.type == "meta"
        assert part.query_start_loc_host == tuple(ref.query_start_loc.tolist())
        assert part.seq_lens_host == tuple(ref.seq_lens.tolist())
        assert part.num_actual_tokens == ref.query_start_loc.tolist()[-1]
