"""The runtime on a real GPU: `python -m pytest -m cuda` (skipped with a reason without CUDA,
see tests/conftest.py). Written against torch's documented CUDA APIs; it has not run on this
project's CPU machines.

- generate on CUDA in fp32 gives the CPU's greedy tokens; DBO on/off agree on CUDA;
- the UBatchContext stream/event protocol on real streams;
- a full graph of a DBO decode step, captured with the ubatch workers live and replayed with
  none, equals eager and follows its inputs;
- no host sync (`torch.cuda.set_sync_debug_mode("error")`) in a capture or an eager DBO step;
- the on-device fabric's spin really holds back the receiving stream.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, OverlapConfig
from tandem.contexts import (
    ForwardContext,
    dbo_switch_to_comm,
    dbo_switch_to_compute_sync,
    dbo_yield,
    make_ubatch_contexts,
    run_ubatches,
    set_forward_context,
)
from tandem.platform import get_platform
from tandem.engine.offline import build_runner, generate
from tandem.worker.sampling import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = ["Experts everywhere", "Hi", "Dual batch overlap hides the all-to-all", "MoE"]


def _config(device: str, *, dbo: bool = False, graph_mode: str = "none") -> EngineConfig:
    return EngineConfig(
        overlap=OverlapConfig(enable_dbo=dbo, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0, graph_mode=graph_mode),
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
        max_num_batched_tokens=128,
        device=device,
        dtype="float32",
    )


def _greedy_tokens(config_or_runner, max_tokens: int = 8) -> list[list[int]]:
    runner = build_runner(config_or_runner) if isinstance(config_or_runner, EngineConfig) else config_or_runner
    tok = runner.info.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in generate(runner, [(i, tok.encode(p).ids, params) for i, p in enumerate(PROMPTS)])]


@contextlib.contextmanager
def _exact_fp32():
    """fp32 matmuls without TF32, so CUDA and CPU agree to rounding."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextlib.contextmanager
def _no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_generate_on_cuda_fp32_gives_the_cpu_greedy_tokens():
    with _exact_fp32():
        runner = build_runner(_config("cuda"))
        assert runner.device.type == "cuda" and runner.platform.name == "cuda"
        assert all(p.is_cuda for p in runner.model.parameters())
        assert _greedy_tokens(runner) == _greedy_tokens(_config("cpu"))


def test_dbo_on_and_off_agree_on_cuda():
    with _exact_fp32():
        off = _greedy_tokens(_config("cuda"))
        on = _greedy_tokens(_config("cuda", dbo=True))
    assert on == off


def _cycles(seconds: float) -> int:
    from tandem.modular_kernels.device_fabric import spin_cycles_per_second

    return int(seconds * spin_cycles_per_second(torch.cuda.current_device()))


def test_ubatch_comm_work_finishes_before_compute_that_waits_on_it():
    platform = get_platform("cuda")
    flag = torch.zeros(1, device="cuda")
    seen = []

    def sender():
        dbo_switch_to_comm()
        torch.cuda._sleep(_cycles(0.05))  # 50 ms on the comm stream
        flag.fill_(1.0)  # lands after the spin, on the comm stream
        dbo_switch_to_compute_sync()  # compute stream waits for the comm-done event
        seen.append(flag * 2)
        dbo_yield()

    def other():
        dbo_yield()

    contexts = make_ubatch_contexts(2, platform=platform)
    assert contexts[0].comm_stream != contexts[0].compute_stream
    run_ubatches([sender, other], contexts=contexts)
    torch.cuda.synchronize()
    assert seen[0].item() == 2.0, "compute read the flag before the comm stream's kernel finished"


def test_without_the_wait_compute_does_not_wait_for_comm():
    """The control: the same spin with no event wait leaves compute free to run first, so the
    previous test's result comes from the protocol, not from stream serialisation."""
    comm = torch.cuda.Stream()
    flag = torch.zeros(1, device="cuda")
    comm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm):
        torch.cuda._sleep(_cycles(0.05))
        flag.fill_(1.0)
    early = flag * 2  # on the default stream, no wait
    torch.cuda.synchronize()
    assert early.item() == 0.0


@pytest.fixture(scope="module")
def one_rank_nccl():
    """A one-rank NCCL group in this process, for the torch_a2a_ll backend."""
    import torch.distributed as dist

    from tandem.testing import find_free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(find_free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="env://", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _tiny(all2all: str, moe_backend: str, group=None):
    from tandem.modular_kernels import MoEConfig
    from tandem.models.tiny_moe import build_tiny_moe

    budget = 16 if all2all in ("torch_a2a_ll", "deepep_low_latency") else None
    options = MoEConfig(all2all_backend=all2all, moe_backend=moe_backend, group=group, dispatch_max_tokens_per_rank=budget)
    return build_tiny_moe(options, dtype=torch.float32, device="cuda").model


def _decode_batch(model, tokens: list[int], positions: list[int]):
    """A decode step where every row is a request (no padding), with its KV cache."""
    from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches, build_step_inputs

    if not hasattr(model, "_test_allocator"):
        model._test_allocator = BlockAllocator(64, reserve_null_block=True)
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 64, 4, device="cuda"))
        model._test_blocks = [model._test_allocator.allocate(4) for _ in tokens]
    chunks = [ScheduledChunk([t], p, blocks) for t, p, blocks in zip(tokens, positions, model._test_blocks)]
    return build_step_inputs(chunks, 4, device="cuda")


def _forward(wrapper, inputs, num_ubatches: int):
    from tandem.ubatch import split_by_tokens

    slices = split_by_tokens(inputs.num_scheduled_tokens, num_ubatches) if num_ubatches else None
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata, ubatch_slices=slices)):
        return wrapper(inputs.input_ids, inputs.positions).clone()


def test_full_graph_of_a_dbo_decode_step_replays_without_workers(one_rank_nccl):
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    model = _tiny("torch_a2a_ll", "torch", one_rank_nccl)
    eager = UBatchWrapper(model, num_ubatches=2)
    graphed = UBatchWrapper(model, num_ubatches=2, graph_mode="full", max_blocks_per_seq=4)
    assert graphed.platform.name == "cuda"
    outputs = []
    for step in range(3):
        inputs = _decode_batch(model, [10 + step, 20, 30 + 2 * step, 40], [step + 1, 2, 3, 4])
        reference = _forward(eager, inputs, 2)
        switches = graphed.executor.switches
        out = _forward(graphed, inputs, 2)
        if step > 0:
            assert graphed.executor.switches == switches, "a replay switched ubatches"
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
        outputs.append(out)
    assert graphed.graph_captures == 1 and graphed.graph_replays == 2
    assert not torch.allclose(outputs[1], outputs[2]), "the replay did not follow its new inputs"


def test_capture_of_a_dbo_decode_step_has_no_host_sync(one_rank_nccl):
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    model = _tiny("torch_a2a_ll", "torch", one_rank_nccl)
    graphed = UBatchWrapper(model, num_ubatches=2, graph_mode="full", max_blocks_per_seq=4)
    inputs = _decode_batch(model, [1, 2, 3, 4], [1, 1, 1, 1])
    _forward(UBatchWrapper(model, num_ubatches=2), inputs, 2)  # lazy init first: NCCL communicator, cuBLAS
    with _no_host_sync():
        _forward(graphed, inputs, 2)
    assert graphed.graph_captures == 1


@pytest.mark.parametrize("all2all, moe_backend", [("local", "triton"), ("torch_a2a_ll", "torch")])
def test_eager_dbo_decode_step_has_no_host_sync(all2all, moe_backend, request, monkeypatch):
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    # Other test modules set TRITON_INTERPRET=1 at import; the interpreter copies every tensor
    # to the host (a sync), so the compiled kernels must run here (review N9).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if moe_backend == "triton":
        pytest.importorskip("triton")  # local pairs with STANDARD experts; torch's loops on the host
    group = request.getfixturevalue("one_rank_nccl") if all2all == "torch_a2a_ll" else None
    model = _tiny(all2all, moe_backend, group)
    wrapper = UBatchWrapper(model, num_ubatches=2)
    _forward(wrapper, _decode_batch(model, [5, 6, 7, 8], [1, 1, 1, 1]), 2)  # warm-up: lazy init, compiles
    inputs = _decode_batch(model, [9, 10, 11, 12], [2, 2, 2, 2])
    with _no_host_sync():
        _forward(wrapper, inputs, 2)
    assert wrapper.ubatched_runs == 2


def test_empty_cuda_capture_is_refused():
    from tandem.platform import GraphCaptureError

    graph = get_platform("cuda").new_graph()
    x = torch.ones(4)  # CPU: nothing reaches the GPU
    with pytest.raises(GraphCaptureError):  # "recorded no CUDA work" (or torch's own capture error)
        graph.capture(lambda: x * 2)
    assert not graph.captured


def test_device_fabric_spin_occupies_the_comm_stream():
    """A 20 ms modelled transfer per dispatch and combine: the step waits for every spin on
    the GPU (the host never blocks), and results are unchanged."""
    from tandem.modular_kernels import FabricModel
    from tandem.modular_kernels.device_fabric import install_device_fabric
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    model = _tiny("local", "torch")
    inputs = _decode_batch(model, [1, 2, 3, 4], [1, 1, 1, 1])
    plain = _forward(UBatchWrapper(model), inputs, 0)
    assert install_device_fabric(model, FabricModel(20e-3, float("inf"))) == 2
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    modelled = _forward(UBatchWrapper(model), inputs, 0)
    end.record()
    end.synchronize()
    # Two MoE layers x (dispatch + combine) x 20 ms, serialised on the GPU.
    assert start.elapsed_time(end) >= 4 * 20 * 0.9
    torch.testing.assert_close(modelled, plain)
