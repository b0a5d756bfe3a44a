"""UBatchWrapper: DBO ubatches give the plain forward's result; full graphs captured with
the ubatch workers running replay new inputs with no worker at all."""

from __future__ import annotations

import pytest
import torch

from tandem.contexts import ForwardContext, set_forward_context
from tandem.modular_kernels import MoEConfig
from tandem.models.tiny_moe import build_tiny_moe
from tandem.platform import GraphCaptureError
from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches, blocks_needed, build_step_inputs
from tandem.worker.ubatch_wrapper import UBatchWrapper, merge_outputs
from tandem.testing import run_distributed
from tandem.ubatch import split_by_tokens

BLOCK = 4


class Batch:
    """Sequences with their own KV blocks in one shared cache of `model`."""

    def __init__(self, model, num_blocks: int = 96):
        self.model = model
        self.allocator = BlockAllocator(num_blocks, reserve_null_block=True)
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK))

    def chunks(self, sequences: list[dict]) -> list[ScheduledChunk]:
        out = []
        for seq in sequences:
            seq.setdefault("blocks", [])
            seq.setdefault("computed", 0)
            need = blocks_needed(len(seq["tokens"]), BLOCK) - len(seq["blocks"])
            if need > 0:
                seq["blocks"] += self.allocator.allocate(need)
            out.append(ScheduledChunk(seq["tokens"][seq["computed"] :], seq["computed"], seq["blocks"]))
        return out

    def run(self, runner, sequences, *, num_ubatches=0, padded=None, commit=True) -> torch.Tensor:
        chunks = self.chunks(sequences)
        inputs = build_step_inputs(chunks, BLOCK, padded)
        slices = None
        if num_ubatches:
            slices = split_by_tokens(inputs.num_scheduled_tokens, num_ubatches, num_tokens_padded=padded)
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata, ubatch_slices=slices)):
            hidden = runner(inputs.input_ids, inputs.positions)
        if commit:
            for seq in sequences:
                seq["computed"] = len(seq["tokens"])
        return hidden[: inputs.num_tokens].clone()


def _prompts(seed: int, lengths: list[int]) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in lengths]


def test_merge_outputs_concatenates_tensors_and_tuples():
    a, b = torch.arange(3.0), torch.arange(3.0, 5.0)
    assert torch.equal(merge_outputs([a, b]), torch.arange(5.0))
    merged = merge_outputs([(a, a[:1]), (b, b[:1])])
    assert isinstance(merged, tuple) and torch.equal(merged[1], torch.tensor([0.0, 3.0]))
    with pytest.raises(TypeError, match="cannot merge ubatch outputs of type dict"):
        merge_outputs([{}, {}])


@pytest.mark.parametrize("executor,num_ubatches", [("thread", 2), ("greenlet", 2), ("thread", 3), ("stages", 2), ("stages", 3)])
def test_ubatched_mixed_batch_matches_plain_forward(executor, num_ubatches):
    model = build_tiny_moe().model
    batch = Batch(model)
    wrapper = UBatchWrapper(model, num_ubatches=max(num_ubatches, 2), executor=executor)
    sequences = _prompts(0, [5, 3, 7])
    batch.run(model, sequences)  # prefill
    for seq, extra in zip(sequences, ([11, 12], [13], [14, 15, 16])):
        seq["tokens"] += extra
    # A decode step plus a new long prompt that the ubatch boundary cuts in two.
    sequences += _prompts(1, [13])
    plain = batch.run(model, sequences, commit=False)
    ubatched = batch.run(wrapper, sequences, num_ubatches=num_ubatches, padded=24)
    torch.testing.assert_close(ubatched, plain, rtol=0, atol=1e-5)
    assert (wrapper.ubatched_runs, wrapper.eager_runs) == (1, 0)
    assert wrapper.executor.switches > 0


def test_failing_ubatch_raises_and_wrapper_recovers():
    class Boom(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Boom.calls += 1
            if Boom.calls == 2:
                raise ValueError("injected failure in ubatch 1")
            return x * 2

    wrapper = UBatchWrapper(Boom(), executor="thread", timeout=5)
    slices = split_by_tokens([1] * 4, 2)
    with set_forward_context(ForwardContext(ubatch_slices=slices)):
        with pytest.raises(ValueError, match="injected failure"):
            wrapper(torch.ones(4))
        assert torch.equal(wrapper(torch.ones(4)), torch.full((4,), 2.0))


def test_capture_refuses_host_sync_with_named_op():
    class SyncsOnHost(torch.nn.Module):
        def forward(self, input_ids, positions):
            scale = float(input_ids.float().mean().item())  # a host sync
            return input_ids.float() * scale

    wrapper = UBatchWrapper(SyncsOnHost(), graph_mode="full", max_blocks_per_seq=8)
    batch_inputs = build_step_inputs([ScheduledChunk([3], 4, [1, 2]), ScheduledChunk([5], 1, [3])], BLOCK, 4)
    with set_forward_context(ForwardContext(attn_metadata=batch_inputs.attn_metadata)):
        with pytest.raises(GraphCaptureError, match="_local_scalar_dense") as info:
            wrapper(batch_inputs.input_ids, batch_inputs.positions)
    assert info.value.op == "aten._local_scalar_dense"
    assert wrapper.graph_captures == 0 and not wrapper.graphs


def _graph_replay_rank(rank: int, world: int, num_ubatches: int, executor: str):
    import torch.distributed as dist

    options = MoEConfig(all2all_backend="torch_a2a_ll", group=dist.group.WORLD, dispatch_max_tokens_per_rank=16)
    model = build_tiny_moe(options).model
    batch = Batch(model)
    eager = UBatchWrapper(model, num_ubatches=max(num_ubatches, 2), executor=executor)
    graphed = UBatchWrapper(model, num_ubatches=max(num_ubatches, 2), executor=executor, graph_mode="full", max_blocks_per_seq=8)
    sequences = _prompts(10 + rank, [4 + rank, 6, 3][: 2 + rank])
    batch.run(eager, sequences)  # prefill: not decode-only, so it runs eagerly
    ubatches = num_ubatches if num_ubatches > 1 else 0
    mismatches, forward_calls = [], []
    original_forward = model.forward

    def counting_forward(*args, **kwargs):
        forward_calls.append(1)
        return original_forward(*args, **kwargs)

    model.forward = counting_forward
    # The stages executor enters the model through its operations, not its forward.
    original_inputs = model.operations_inputs

    def counting_inputs(*args, **kwargs):
        forward_calls.append(1)
        return original_inputs(*args, **kwargs)

    model.operations_inputs = counting_inputs
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        for seq in sequences:
            seq["tokens"].append(int(torch.randint(0, 256, (1,), generator=gen)))
        # Same padded size on every rank: one graph for all steps.
        reference = batch.run(eager, sequences, num_ubatches=ubatches, padded=4, commit=False)
        calls_before, switches_before = len(forward_calls), graphed.executor.switches
        out = batch.run(graphed, sequences, num_ubatches=ubatches, padded=4)
        mismatches.append(float((out - reference).abs().max()))
        if step > 0:  # replays: no model Python, no ubatch switch
            assert len(forward_calls) == calls_before, "a replay ran model code"
            assert graphed.executor.switches == switches_before, "a replay switched ubatches"
    return {
        "mismatch": max(mismatches),
        "captures": graphed.graph_captures,
        "replays": graphed.graph_replays,
        "graph_threads": next(iter(graphed.graphs.values())).graph.num_threads,
    }


@pytest.mark.slow
@pytest.mark.parametrize("num_ubatches,executor", [(2, "thread"), (3, "greenlet"), (0, "thread"), (2, "stages")])
def test_graph_replay_matches_eager_on_new_inputs(num_ubatches, executor):
    results = run_distributed(_graph_replay_rank, 2, num_ubatches, executor, timeout_s=240)
    for result in results:
        assert result["mismatch"] <= 1e-5, result
        assert result["captures"] == 1 and result["replays"] == 3, result
        if num_ubatches and executor == "thread":
            # The capturing thread plus one worker per ubatch recorded ops.
            assert result["graph_threads"] == 1 + num_ubatches, result
        if executor == "stages":
            assert result["graph_threads"] == 1, result  # TBO runs on the capturing thread
