"""tandem's CUDA paths on fake CUDA tensors (see `harness.py`): the model, KV cache, step
inputs and a DBO decode step, eager and under capture semantics, for every dispatch x expert
backend pair that claims to be graph-capturable. Any host sync, CPU/CUDA mix, dtype or shape
error fails. Needs the CUDA build of torch (`.ci/run` makes a venv for it); skipped on the
CPU build. Run: `python -m pytest -m fakecuda tests/fakecuda`."""

from __future__ import annotations

import pytest
import torch

from tests.fakecuda.harness import FAKECUDA_MARKS  # noqa: E402

pytestmark = FAKECUDA_MARKS

from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from tests.fakecuda import harness  # noqa: E402

#: (all2all, moe backend) pairs whose kernel claims `graph_capturable`.
CAPTURABLE = [
    ("local", "triton"),
    ("local", "deep_gemm"),
    ("torch_a2a_ll", "torch"),
    ("torch_a2a_ll", "triton"),
    ("torch_a2a_ll", "deep_gemm"),
    ("deepep_low_latency", "torch"),
    ("deepep_low_latency", "triton"),
    ("deepep_low_latency", "deep_gemm"),
]
HOST_SYNC = (DataDependentOutputException, DynamicOutputShapeException)
BLOCK = 4


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Stubs at the GPU libraries' boundary and the fake-capture platform for "cuda"."""
    from tandem.modular_kernels.prepare_deepep import release_shared_buffers

    harness.use_fake_cuda_platform(monkeypatch)
    stubs = {
        "triton": harness.stub_triton(monkeypatch),
        "deep_gemm": harness.stub_deep_gemm(monkeypatch),
        "deep_ep": harness.stub_deep_ep(monkeypatch),
    }
    release_shared_buffers()
    yield stubs
    release_shared_buffers()


#: tiny-moe's architecture at sizes every backend takes: DeepEP's low-latency kernels exist
#: for hidden 2048 and up, DeepGEMM's fp8 blocks are 128 wide. Fake tensors hold no memory.
SIZES = {"hidden_size": 2048, "intermediate_size": 256, "moe_intermediate_size": 128}


def _model(all2all: str, moe_backend: str, group, dtype=torch.bfloat16):
    from tandem.modular_kernels import MoEConfig
    from tandem.models.deepseek import DeepseekV3ForCausalLM
    from tandem.models.tiny_moe import CONFIG

    options = MoEConfig(
        all2all_backend=all2all, moe_backend=moe_backend, group=None if all2all == "local" else group,
        # The one dispatch budget; a backend without a fixed buffer (local) refuses one.
        dispatch_max_tokens_per_rank=None if all2all == "local" else 16,
    )
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(dict(CONFIG, **SIZES), moe=options, dtype=dtype)
        model.prepare_weights_after_loading()  # as the loader does: deep_gemm's experts hold block-fp8 weights
    return model.eval()


def on_fake_cuda(inputs, keep_on_host=()):
    """Step inputs built on the host (real tensors: the host part of `build_step_inputs`
    reads its own host lists), then moved to the device (a plain non-blocking copy: fake
    tensors cannot be pinned, so `to_device_async`'s staging is not exercised here)."""
    import dataclasses

    def move(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, torch.Tensor) and f.name not in keep_on_host:
                changes[f.name] = value.to("cuda", non_blocking=True)
            elif dataclasses.is_dataclass(value):
                changes[f.name] = move(value)
        return dataclasses.replace(obj, **changes)

    return move(inputs)


def _host_inputs(chunks):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from tandem.worker import build_step_inputs

    with unset_fake_temporarily():
        return build_step_inputs(chunks, BLOCK)


def _decode_inputs(model, step: int, keep_on_host=()):
    from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches

    if not hasattr(model, "_fake_blocks"):
        allocator = BlockAllocator(32, reserve_null_block=True)
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 32, BLOCK, device="cuda"))
        model._fake_blocks = [allocator.allocate(2) for _ in range(4)]
    chunks = [ScheduledChunk([10 + i + step], 1 + i + step, b) for i, b in enumerate(model._fake_blocks)]
    return on_fake_cuda(_host_inputs(chunks), keep_on_host)


def _step(wrapper, inputs, num_ubatches: int):
    from tandem.contexts import ForwardContext, set_forward_context
    from tandem.ubatch import split_by_tokens

    slices = split_by_tokens(inputs.num_scheduled_tokens, num_ubatches) if num_ubatches else None
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata, ubatch_slices=slices)):
        return wrapper(inputs.input_ids, inputs.positions)


def _run_steps(all2all, moe_backend, group, *, graph_mode: str, steps: int = 2, keep_on_host=()):
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model(all2all, moe_backend, group)
        assert all(p.device.type == "cuda" for p in model.parameters())
        wrapper = UBatchWrapper(model, num_ubatches=2, executor="greenlet", graph_mode=graph_mode, max_blocks_per_seq=2)
        outs = []
        for step in range(steps):
            inputs = _decode_inputs(model, step, keep_on_host)
            out = _step(wrapper, inputs, 2)
            assert out.device.type == "cuda" and out.shape[0] == inputs.input_ids.shape[0]
            outs.append(out)
    return wrapper, outs


@pytest.mark.parametrize("all2all, moe_backend", CAPTURABLE)
@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_dbo_decode_step_on_fake_cuda(all2all, moe_backend, graph_mode, fake_cuda, one_rank_group):
    wrapper, _ = _run_steps(all2all, moe_backend, one_rank_group, graph_mode=graph_mode)
    assert wrapper.ubatched_runs >= 1 or wrapper.graph_captures >= 1
    if graph_mode == "full":
        assert wrapper.graph_captures == 1
    if moe_backend == "triton":  # the log also holds the decode attention's launches
        assert {"grouped_gemm", "masked_gemm"} & set(fake_cuda["triton"]), "no triton expert launch reached the stub"
    if moe_backend == "deep_gemm":
        assert fake_cuda[moe_backend], f"no {moe_backend} launch reached the stub"
    if all2all == "deepep_low_latency":
        assert "dispatch" in fake_cuda["deep_ep"] and "combine" in fake_cuda["deep_ep"]


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_decode_attention_takes_the_triton_split_kv_kernels_on_cuda(graph_mode, fake_cuda, one_rank_group):
    """Each MLA layer of each ubatch launches the split stage then the merge, and no torch
    gather of the whole block table runs (a host read or a CPU tensor fails the stub)."""
    wrapper, _ = _run_steps("local", "deep_gemm", one_rank_group, graph_mode=graph_mode, steps=1)
    from tandem.models.tiny_moe import CONFIG

    ubatches = 2
    attention = [name for name in fake_cuda["triton"] if name in ("decode_split", "merge_splits")]
    assert attention == ["decode_split", "merge_splits"] * (CONFIG["num_hidden_layers"] * ubatches)


def test_prefill_step_on_fake_cuda_without_dbo(fake_cuda, one_rank_group):
    from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model("torch_a2a_ll", "triton", one_rank_group)
        allocator = BlockAllocator(32, reserve_null_block=True)
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 32, BLOCK, device="cuda"))
        chunks = [ScheduledChunk(list(range(1, 6)), 0, allocator.allocate(2)), ScheduledChunk([7, 8], 0, allocator.allocate(1))]
        out = _step(UBatchWrapper(model, executor="greenlet"), on_fake_cuda(_host_inputs(chunks)), 0)
        assert out.device.type == "cuda" and out.shape[0] == 7


# -------------------------------------------------------------- the job catches regressions


def test_catches_a_host_sync_bincount_in_triton_alignment(fake_cuda, one_rank_group, monkeypatch):
    """gpu-review D2: `bincount` (a data-dependent output size) back in align_pairs_by_expert."""
    from tandem.modular_kernels import experts_triton

    real = experts_triton.align_pairs_by_expert

    def with_bincount(ids, num_experts, block_m):
        torch.bincount(ids.flatten().clamp(min=0), minlength=num_experts)
        return real(ids, num_experts, block_m)

    monkeypatch.setattr(experts_triton, "align_pairs_by_expert", with_bincount)
    with pytest.raises(HOST_SYNC):
        _run_steps("local", "triton", one_rank_group, graph_mode="none", steps=1)


@pytest.mark.parametrize("tokens, kernel", [(8, True), (682, True), (683, False), (1024, False)])
def test_align_takes_the_one_program_kernel_only_up_to_its_pair_limit(tokens, kernel, fake_cuda):
    """gpu-review-3 G4: the kernel is one CTA walking the pairs in order; a prefill's pairs
    (6 per token here, 4,096 at most) go to the sort instead. Both give the same rows."""
    from tandem.modular_kernels.moe_align import TRITON_ALIGN_MAX_PAIRS, align_pairs_by_expert

    assert TRITON_ALIGN_MAX_PAIRS == 4096
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.empty(tokens, 6, dtype=torch.int64, device="cuda")
        sorted_ids, block_expert = align_pairs_by_expert(ids, 64, 16)
    assert sorted_ids.device.type == "cuda" and block_expert.device.type == "cuda"
    assert ("align" in fake_cuda["triton"]) == kernel


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_catches_cpu_attention_metadata(graph_mode, fake_cuda, one_rank_group):
    """gpu-review B3: the attention metadata's `seq_lens` left on the CPU."""
    with pytest.raises(Exception, match="(?i)device|cpu|cuda"):
        _run_steps("local", "triton", one_rank_group, graph_mode=graph_mode, steps=1, keep_on_host=("seq_lens",))


def test_catches_the_standard_torch_experts_host_sync(fake_cuda, one_rank_group):
    """Review N7: the STANDARD torch experts call `nonzero` per expert (not capturable)."""
    with pytest.raises(HOST_SYNC):
        _run_steps("local", "torch", one_rank_group, graph_mode="none", steps=1)


def test_catches_a_dtype_error(fake_cuda, one_rank_group, monkeypatch):
    """A float32 activation reaching DeepGEMM's fp8 GEMM fails at the stubbed boundary."""
    from tandem.modular_kernels import experts_deep_gemm

    monkeypatch.setattr(experts_deep_gemm, "FP8_DTYPE", torch.float32)
    with pytest.raises(Exception, match="fp8|dtype|Float"):
        _run_steps("torch_a2a_ll", "deep_gemm", one_rank_group, graph_mode="none", steps=1)


def test_decode_step_launches_the_fused_kernels(fake_cuda, one_rank_group):
    """On CUDA the layer's small ops are single Triton kernels: residual-add + RMSNorm, RoPE +
    cache write, routing top-k (grouped here: tiny-moe is V3-shaped), the align step, the
    experts' GEMMs and the shared experts' SiLU-and-mul."""
    _run_steps("local", "triton", one_rank_group, graph_mode="none", steps=1)
    launched = set(fake_cuda["triton"])
    assert {"add_rms_norm", "rope_cache", "topk", "align", "grouped_gemm", "silu_and_mul"} <= launched


def _counted_decode_step(wrapper, model, num_ubatches: int):
    from tandem.bench.op_count import OpCounter

    inputs = _decode_inputs(model, 0)
    with OpCounter() as counter:
        out = _step(wrapper, inputs, num_ubatches)
    return out, counter


def test_tbo_step_concatenates_only_the_final_hidden(fake_cuda, one_rank_group):
    """Review of G9: each ubatch's final norm adds its last residual before the ubatches are
    merged, so a TBO decode step concatenates one [T, H] tensor (the normalised rows), not the
    hidden states, the residual and the positions apart (3 `cat`s)."""
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model("local", "triton", one_rank_group)
        wrapper = UBatchWrapper(model, num_ubatches=2, executor="stages", max_blocks_per_seq=2)
        out, counter = _counted_decode_step(wrapper, model, 2)
    assert wrapper.ubatched_runs == 1 and out.shape == (4, SIZES["hidden_size"])
    assert counter.by_op["cat"] == 1, counter.by_op.most_common(20)


def test_final_norm_keeps_no_residual_alive(fake_cuda, one_rank_group):
    """Review of G9: the model's output (the final norm of the last layer's output and
    residual) owns only its own [T, H] rows; `fused_add_rms_norm` allocates the sum beside the
    normalised rows, and taking `[0]` of it kept both halves alive (in a CUDA graph's pool too)."""
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model("local", "triton", one_rank_group)
        out, counter = _counted_decode_step(UBatchWrapper(model, executor="greenlet"), model, 0)
        assert counter.triton_by_kernel["add_rms_norm_kernel"] > 0
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
