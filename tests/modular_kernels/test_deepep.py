"""The DeepEP adapters against the oracle and the torch backends, on the CPU emulation of
DeepEP's API (`tandem.testing.fake_deep_ep`) over real gloo process groups; and the
emulation's own contract (layouts, hooks, the checks DeepEP makes)."""

import sys

import pytest
import torch
import torch.distributed as dist

from tandem.contexts import dbo_current_ubatch_id

from tandem.modular_kernels import (
    ALL2ALL_BACKENDS,
    ActivationFormat,
    FusedMoEModularKernel,
    TorchBatchedExperts,
    build_moe_kernel,
    dequantize_fp8,
    quantize_fp8_per_token_group,
    torch_moe_reference,
)
from tandem.modular_kernels.prepare_deepep import (
    DeepEPHighThroughputPrepareAndFinalize,
    DeepEPLowLatencyPrepareAndFinalize,
    check_low_latency_budget,
    ht_buffer_sms_limit,
    release_shared_buffers,
)
from tandem.modular_kernels.sm_partition import comm_sm_partition
from tandem.testing import fake_deep_ep, run_distributed
from tests.support.moe_cases import (
    dispatch_budget,
    NUM_EXPERTS,
    TOP_K,
    RecordingPrepareFinalize,
    assert_every_case_passed,
    failing_import,
    make_problem,
    run_kernel,
)

# DeepEP's low-latency kernels only exist for a few hidden sizes; 2048 is the smallest.
HIDDEN = 2048
MAX_TOKENS = 16
LL, HT = "deepep_low_latency", "deepep_high_throughput"
TWIN = {LL: "torch_a2a_ll", HT: "torch_a2a"}  # the torch backend with the same semantics


def _build(all2all, **kwargs):
    return build_moe_kernel(
        all2all, "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **dispatch_budget(all2all, MAX_TOKENS),
        **kwargs,
    )


def _problem(rank, routing, **kwargs):
    return make_problem(rank, routing, hidden=HIDDEN, intermediate=32, **kwargs)


def _max_err(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------ bf16 exactness + DBO

#: bf16 agreement with the float32 oracle (inputs rounded to bf16 at the adapter, outputs
#: rounded to bf16 on the expert rank and after combine).
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)


#: The order of sends and receives of two ubatches. Low latency: the receive of one ubatch
#: is issued by the other. High throughput: each ubatch yields before its CPU-blocking
#: dispatch (and combine), so both send back to back, each after the other queued its work.
DBO_SCHEDULE = {
    LL: [
        ("send_dispatch", 0), ("recv_dispatch", 0, "by", 1), ("send_dispatch", 1), ("recv_dispatch", 1, "by", 0),
        ("send_combine", 0), ("recv_combine", 0, "by", 1), ("send_combine", 1), ("recv_combine", 1, "by", 0),
    ],
    HT: [
        ("send_dispatch", 0), ("send_dispatch", 1), ("recv_dispatch", 1, "by", 0), ("recv_dispatch", 0, "by", 1),
        ("send_combine", 0), ("send_combine", 1), ("recv_combine", 1, "by", 0), ("recv_combine", 0, "by", 1),
    ],
}


def _same(a, b):
    """Equal up to one bf16 rounding (a ubatch's GEMMs see fewer rows, summing differently)."""
    return bool(torch.allclose(a.float(), b.float(), rtol=2**-7, atol=2**-8))


def _oracle(out, problem):
    return bool(torch.allclose(out.float(), problem.reference().float(), **BF16_TOL))


def _exact_cases(rank, world):
    fake_deep_ep.install()  # bf16 only, as DeepEP
    kernels = {name: _build(name) for name in (LL, HT, *TWIN.values())}
    report = {}
    for routing in ("random", "one_expert", "masked", "rank1-empty"):
        if routing == "rank1-empty":  # rank 1 has no tokens; rank 0 still routes to its experts
            p = _problem(rank, "empty" if rank == 1 else "random")
        else:
            p = _problem(rank, routing)
        p.hidden = p.hidden.to(torch.bfloat16)
        out = {name: run_kernel(k, p, rank, world) for name, k in kernels.items()}
        ref = p.reference().float()
        for name in (LL, HT):
            report[f"{name}/{routing}/oracle"] = bool(torch.allclose(out[name].float(), ref, **BF16_TOL))
            report[f"{name}/{routing}/equal-to-{TWIN[name]}"] = bool(torch.equal(out[name], out[TWIN[name]]))
    # A float32 model: bf16 on DeepEP's side, float32 back to the model.
    p = _problem(rank, "random", num_tokens=MAX_TOKENS)
    for name in (LL, HT):
        out = run_kernel(kernels[name], p, rank, world)
        report[f"{name}/float32-model"] = out.dtype == torch.float32 and bool(
            torch.allclose(out, p.reference(), **BF16_TOL)
        )
        sbo = _build(name, shared_experts=p.shared_experts, enable_sbo=True)
        report[f"{name}/sbo+shared-oracle"] = bool(
            torch.allclose(run_kernel(sbo, p, rank, world), p.reference(with_shared=True), **BF16_TOL)
        )
    p.hidden = p.hidden.to(torch.bfloat16)
    for name in (LL, HT):
        plain = run_kernel(kernels[name], p, rank, world)
        for executor in ("thread", "greenlet"):
            dbo = run_kernel(kernels[name], p, rank, world, num_ubatches=2, executor=executor)
            report[f"{name}/dbo2-{executor}-vs-plain"] = _same(dbo, plain)
        # Under DBO the receive hook of one ubatch is issued by the other one.
        trace = []
        kernel = _build(name)
        kernel.prepare_finalize = RecordingPrepareFinalize(kernel.prepare_finalize, trace)
        run_kernel(kernel, p, rank, world, num_ubatches=2)
        report[f"{name}/dbo-schedule"] = trace == DBO_SCHEDULE[name]
    # One Buffer per process and mode, whatever the number of layers (kernels) and ubatches.
    layers = [_build(name) for name in (LL, LL, HT, HT)]
    for n in (3, 4):  # more ubatches than DeepEP LL's two internal buffers
        for i, layer in enumerate(layers):
            name = layer.prepare_finalize.name
            report[f"layer{i}-{name}/dbo{n}"] = _same(
                run_kernel(layer, p, rank, world, num_ubatches=n), run_kernel(kernels[name], p, rank, world)
            )
    buffers = {k.prepare_finalize.name: set() for k in layers}
    for k in (*layers, kernels[LL], kernels[HT]):
        buffers[k.prepare_finalize.name].add(id(k.prepare_finalize.buffer))
    report["one-buffer-per-mode"] = all(len(ids) == 1 for ids in buffers.values())
    return report


@pytest.mark.slow
def test_adapters_match_the_oracle_and_the_torch_backends_in_bf16():
    per_rank = run_distributed(_exact_cases, 2, timeout_s=240)
    assert_every_case_passed(per_rank, 2 * (4 * 2 + 5) + 4 * 2 + 1)


# ------------------------------------------------------------------ strict emulation (bf16, fp8)


def _raises(fn, exc, text):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{exc.__name__} without {text!r}: {e}"
        return True
    raise AssertionError(f"no {exc.__name__} ({text!r})")


def _strict_cases(rank, world):

    deep_ep = fake_deep_ep.install()
    group = dist.group.WORLD
    E, El, T, H = NUM_EXPERTS, NUM_EXPERTS // world, MAX_TOKENS, HIDDEN
    report = {}

    # Before any shared Buffer exists: a Buffer too small for the dispatch (then freed, as
    # NVSHMEM allows one low-latency Buffer per process).
    x1 = torch.ones(1, H, dtype=torch.bfloat16)
    small = deep_ep.Buffer(group, 0, 128 * 64, low_latency_mode=True, num_qps_per_rank=El, explicitly_destroy=True)
    report["buffer-too-small"] = _raises(
        lambda: small.low_latency_dispatch(x1, torch.zeros(1, 2, dtype=torch.int64), T, E), RuntimeError, "num_rdma_bytes"
    )
    small.destroy()

    # bf16 end to end, with and without fp8 dispatch.
    p = _problem(rank, "masked")
    p.hidden = p.hidden.to(torch.bfloat16)
    for name in (LL, HT):
        for fp8 in (False, True):
            out = run_kernel(_build(name, use_fp8_dispatch=fp8), p, rank, world)
            assert out.dtype == torch.bfloat16
            x = dequantize_fp8(*quantize_fp8_per_token_group(p.hidden), torch.float32) if fp8 else p.hidden.float()
            ref = torch_moe_reference(x, p.w1, p.w2, p.topk_weights, p.topk_ids)
            # bf16 tolerance (the output is rounded to bf16 on the expert rank and after combine);
            # with fp8, DeepEP's own cast may differ from tandem's by one fp8 step on a few values.
            close = torch.allclose(out.float(), ref, rtol=1.6e-2, atol=2e-2 if fp8 else 1e-2)
            report[f"{name}/bf16/fp8={fp8}"] = bool(close)

    # The process's shared low-latency Buffer; a second one is refused (nvshmem::init).
    buf = _build(LL).prepare_finalize.ensure_buffer(H)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    report["second-nvshmem-buffer"] = _raises(
        lambda: deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=El), RuntimeError, "one NVSHMEM"
    )

    # An adapter over a Buffer built by the caller.
    own = FusedMoEModularKernel(DeepEPLowLatencyPrepareAndFinalize(E, T, buffer=buf), TorchBatchedExperts())
    report["caller-buffer"] = bool(torch.equal(run_kernel(own, p, rank, world), run_kernel(_build(LL), p, rank, world)))
    ll = buf.low_latency_dispatch
    ids = torch.tensor([[0, 5], [5, -1], [1, 4]], dtype=torch.int64)
    x = (10 * rank + torch.arange(1, 4, dtype=torch.float32)).view(3, 1).expand(3, H).to(torch.bfloat16).contiguous()

    # Constraints DeepEP asserts (all fail before any communication, on every rank alike).
    report["too-many-tokens"] = _raises(
        lambda: ll(torch.zeros(T + 1, H, dtype=torch.bfloat16), torch.zeros(T + 1, 2, dtype=torch.int64), T, E),
        RuntimeError, "num_max_dispatch_tokens_per_rank",
    )
    report["int32-ids"] = _raises(lambda: ll(x, ids.int(), T, E), RuntimeError, "topk_idx_t")
    report["float32-x"] = _raises(lambda: ll(x.float(), ids, T, E), RuntimeError, "kBFloat16")
    report["hidden-1024"] = _raises(
        lambda: ll(x[:, :1024].contiguous(), ids, T, E), RuntimeError, "Unsupported hidden"
    )
    report["experts-not-divisible"] = _raises(lambda: ll(x, ids, T, E - 1), RuntimeError, "num_experts % num_ranks")
    report["async-and-hook"] = _raises(
        lambda: ll(x, ids, T, E, async_finish=True, return_recv_hook=True), RuntimeError, "return_recv_hook"
    )
    report["bad-expert-id"] = _raises(lambda: ll(x, ids + 10, T, E), ValueError, "top-k ids")
    report["qp-depth"] = _raises(lambda: ll(x, ids, 512, E), AssertionError, "NVSHMEM_QP_DEPTH")
    report["tokens-multiple-of-4"] = _raises(lambda: ll(x, ids, 5, E), RuntimeError, "multiple of 4")
    wide = torch.full((3, 12), -1, dtype=torch.int64)
    wide[:, :2] = ids.clamp(min=0)
    report["top-k-11"] = _raises(lambda: ll(x, wide, T, E), RuntimeError, "kNumMaxTopK (11)")
    _, _, _, _, hook = ll(x, wide[:, :11].contiguous(), T, E, use_fp8=False, return_recv_hook=True)
    hook()
    report["unaligned-buffer"] = _raises(lambda: deep_ep.Buffer(group, 100), RuntimeError, "NUM_BUFFER_ALIGNMENT_BYTES")
    layout = buf.get_dispatch_layout(ids, E)
    report["ht-needs-nvl-bytes"] = _raises(
        lambda: buf.dispatch(
            x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], num_tokens_per_expert=layout[2],
            is_token_in_rank=layout[3], topk_idx=ids, topk_weights=torch.ones(3, 2),
        ),
        RuntimeError, "num_nvl_bytes",
    )

    # Low-latency layout: the data arrives only with the hook, packed per expert by source rank.
    recv_x, recv_count, handle, event, hook = ll(x, ids, T, E, use_fp8=False, return_recv_hook=True)
    assert event.event is None and tuple(recv_x.shape) == (El, world * T, H) and recv_x.dtype == torch.bfloat16
    report["stale-before-hook"] = _raises(lambda: recv_x.float(), RuntimeError, "before its receive hook ran")
    hook()
    report["hook-once"] = _raises(hook, RuntimeError, "once")
    src_info, layout_range, *_ = handle
    layout_ok = True
    for e in range(El):
        rows = [(src, t) for src in range(world) for t in range(3) if (ids[t] == rank * El + e).any()]
        layout_ok &= int(recv_count[e]) == len(rows)
        for i, (src, t) in enumerate(rows):
            layout_ok &= float(recv_x[e, i, 0]) == 10 * src + t + 1 and int(src_info[e, i]) == t
        for src in range(world):
            count, begin = int(layout_range[e, src]) & 0xFFFFFFFF, int(layout_range[e, src]) >> 32
            layout_ok &= count == sum(1 for s, _ in rows if s == src) and begin == sum(1 for s, _ in rows if s < src)
    report["ll-layout"] = layout_ok
    # Identity experts; rows past recv_count stay stale and must not be read by combine.
    weights = torch.full((3, 2), 0.5)
    combined, _, hook = buf.low_latency_combine(recv_x, ids, weights, handle, return_recv_hook=True)
    hook()
    expected = x.float() * 0.5 * (ids >= 0).sum(1, keepdim=True)
    report["ll-combine"] = bool(torch.equal(combined.float(), expected))

    # Without a hook the call itself delivers (synchronously, or by the event when async).
    stats = torch.zeros(El, dtype=torch.int32)
    sync_x, sync_count, _, event, no_hook = ll(
        x, ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=False
    )
    async_x, _, _, async_event, _ = ll(x, ids, T, E, use_fp8=False, async_finish=True)
    async_event.current_stream_wait()
    report["ll-sync-and-async"] = (
        no_hook is None and event.event is None and bool(torch.equal(stats, recv_count))
        and all(torch.equal(y[e, :n], recv_x[e, :n]) for y in (sync_x, async_x) for e, n in enumerate(recv_count))
    )
    # zero_copy: the expert output is written straight into the next combine buffer.
    buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    zc, _, _ = buf.low_latency_combine(torch.empty_like(recv_x), ids, weights, handle, zero_copy=True)
    report["ll-zero-copy"] = bool(torch.equal(zc, combined))

    # fp8: scales are [E_local, R*T, H/128] float32, column-major in the last two dims.
    (q, scales), recv_count, handle, _, hook = ll(x, ids, T, E, use_fp8=True, return_recv_hook=True)
    hook()
    report["fp8-scales-layout"] = (
        q.dtype == torch.float8_e4m3fn
        and tuple(scales.shape) == (El, world * T, H // 128)
        and scales.stride()[1:] == (1, world * T)
    )
    n = int(recv_count[0])
    back = dequantize_fp8(q[0, :n], scales[0, :n], torch.float32)
    report["fp8-values"] = _max_err(back, recv_x[0, :n].float()) < 1e-4

    # Two low-latency buffers: a third operation before the first one's receive is an error.
    _, _, _, _, hook_a = ll(x, ids, T, E, use_fp8=False, return_recv_hook=True)
    _, _, _, _, hook_b = ll(x, ids, T, E, use_fp8=False, return_recv_hook=True)
    report["double-buffer"] = _raises(lambda: ll(x, ids, T, E, return_recv_hook=True), RuntimeError, "two")
    hook_a()
    hook_b()

    # High-throughput layout: rows by source rank, local ids (-1 elsewhere, weight 0), async event.
    ht = deep_ep.Buffer(group, deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world))
    per_rank, per_rdma, per_expert, in_rank, _ = ht.get_dispatch_layout(ids, E)
    tw = torch.rand(3, 2)
    (recv_x, recv_ids, recv_w, per_local_expert, handle, event) = ht.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=tw, async_finish=True,
    )
    event.current_stream_wait()
    sent = [(src, t) for src in range(world) for t in range(3) if ((ids[t] // El) == rank).any()]
    report["ht-rows"] = [float(v) for v in recv_x[:, 0]] == [10 * s + t + 1 for s, t in sent]
    local = torch.stack([torch.where(ids[t] // El == rank, ids[t] - rank * El, -1) for _, t in sent])
    report["ht-local-ids"] = bool(torch.equal(recv_ids, local)) and bool((recv_w[local < 0] == 0).all())
    report["ht-per-expert"] = per_local_expert == [int((local == e).sum()) for e in range(El)]
    combined, combined_w, event = ht.combine(recv_x, handle, topk_weights=recv_w, async_finish=True)
    event.current_stream_wait()
    copies = in_rank.sum(1, keepdim=True)
    report["ht-combine"] = bool(torch.equal(combined.float(), x.float() * copies)) and bool(
        torch.allclose(combined_w, torch.where(ids >= 0, tw, 0.0))
    )
    (cached_x, *rest, event) = ht.dispatch(x, handle=handle, async_finish=True)
    event.current_stream_wait()
    report["ht-cached-dispatch"] = bool(torch.equal(cached_x, recv_x)) and rest == [None] * 4
    report["ht-combine-float32"] = _raises(lambda: ht.combine(recv_x.float(), handle), RuntimeError, "kBFloat16")
    return report


@pytest.mark.slow
def test_strict_emulation_bf16_fp8_layouts_and_constraints():
    per_rank = run_distributed(_strict_cases, 2, timeout_s=150)
    assert_every_case_passed(per_rank, 34)


# ------------------------------------------------------------------ v2.1 details, HT order and sizing


def _v21_cases(rank, world):
    deep_ep = fake_deep_ep.install(topk_idx_dtype=torch.int32)  # DeepEP built with EP_NUM_TOPK_IDX_BITS=32
    p = _problem(rank, "random", num_tokens=MAX_TOKENS)
    p.hidden = p.hidden.to(torch.bfloat16)
    report = {}

    # --comm-sms: the HT buffer is sized for the SMs it will be given, and never given more.
    sized = _build(HT, comm_sms=32)
    deep_ep.Buffer.set_num_sms(32)
    report["ht-sized-for-comm-sms"] = _oracle(run_kernel(sized, p, rank, world), p)
    report["ht-sms-limit"] = ht_buffer_sms_limit() == 32
    with comm_sm_partition(48, total_sms=132):
        report["comm-sms-clamped"] = deep_ep.Buffer.num_sms == 32
    # What the sizing prevents: a buffer made for 20 SMs given 32.
    deep_ep.Buffer.set_num_sms(20)
    release_shared_buffers()
    unsized = _build(HT)
    unsized.prepare_finalize.ensure_buffer(HIDDEN)
    deep_ep.Buffer.set_num_sms(32)
    report["unsized-buffer-overflows"] = _raises(lambda: run_kernel(unsized, p, rank, world), RuntimeError, "num_nvl_bytes")
    deep_ep.Buffer.set_num_sms(20)

    # deep_ep.topk_idx_t, whatever width DeepEP was built with.
    for name in (LL, HT):
        report[f"{name}/topk_idx_t"] = _oracle(run_kernel(_build(name), p, rank, world), p)

    # High throughput follows vLLM's order: under DBO record the compute event, yield, then
    # the CPU-blocking layout + dispatch synchronously on the comm stream; combine likewise.
    kernel = _build(HT)
    buffer = kernel.prepare_finalize.ensure_buffer(HIDDEN)
    calls = []

    def record(method):
        inner = getattr(buffer, method)

        def recorded(*args, **kwargs):
            calls.append((method, dbo_current_ubatch_id(), kwargs.get("async_finish")))
            return inner(*args, **kwargs)

        setattr(buffer, method, recorded)

    for method in ("capture", "get_dispatch_layout", "dispatch", "combine"):
        record(method)
    run_kernel(kernel, p, rank, world, num_ubatches=2)
    # The send's own yield is the only one at each transfer (no second yield by the kernel):
    # ubatch 0 dispatches once ubatch 1 has queued its compute, then runs on to its combine.
    report["ht-dbo-order"] = calls == [
        ("capture", 0, None), ("capture", 1, None),
        ("get_dispatch_layout", 0, False), ("dispatch", 0, False), ("capture", 0, None),
        ("get_dispatch_layout", 1, False), ("dispatch", 1, False), ("capture", 1, None),
        ("combine", 0, False), ("combine", 1, False),
    ]
    calls.clear()
    run_kernel(kernel, p, rank, world)
    # Without DBO the dispatch still waits on the event its first half recorded, and the
    # combine on the one recorded right after the experts (what TBO needs: its sends run a stage
    # later, after the other ubatch's work is on the stream).
    report["ht-plain-async"] = calls == [
        ("capture", 0, None), ("get_dispatch_layout", 0, False), ("dispatch", 0, True),
        ("capture", 0, None), ("combine", 0, True),
    ]

    # EventOverlap (v2.1): a hook after the wait, and releasing the handle.
    seen = []
    event = deep_ep.EventOverlap(deep_ep.utils.EventHandle())
    event.register_hook_after_wait(lambda: seen.append("hook"))
    event.current_stream_wait(release_handle=True)
    report["event-v2.1"] = seen == ["hook"] and event.event is None
    report["enable-shrink"] = deep_ep.Buffer(dist.group.WORLD, 1024, enable_shrink=True).enable_shrink is True
    return report


@pytest.mark.slow
def test_v21_details_ht_order_and_comm_sms_sizing():
    per_rank = run_distributed(_v21_cases, 2, timeout_s=150)
    assert_every_case_passed(per_rank, 10)


# ------------------------------------------------------------------ single process


def test_missing_deep_ep_names_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # what a machine without DeepEP sees
    with pytest.raises(ImportError, match="deepep_low_latency.*DeepEP.*own source"):
        DeepEPLowLatencyPrepareAndFinalize(NUM_EXPERTS, MAX_TOKENS)
    with pytest.raises(ImportError, match="deepep_high_throughput.*DeepEP.*own source"):
        DeepEPHighThroughputPrepareAndFinalize(NUM_EXPERTS)


def test_install_and_uninstall_restore_sys_modules():
    before = sys.modules.get("deep_ep")
    with fake_deep_ep.installed() as module:
        import deep_ep
        from deep_ep import Buffer, Config, EventOverlap

        assert deep_ep is module and Buffer is module.Buffer and deep_ep.utils.EventOverlap is EventOverlap
        assert isinstance(Config(), Config)
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and fake_deep_ep.Buffer.num_sms == 20  # per-install state
    assert sys.modules.get("deep_ep") is before


def test_registry_and_formats():
    assert ALL2ALL_BACKENDS[LL].endswith(":DeepEPLowLatencyPrepareAndFinalize")
    assert ALL2ALL_BACKENDS[HT].endswith(":DeepEPHighThroughputPrepareAndFinalize")
    assert DeepEPLowLatencyPrepareAndFinalize.activation_format is ActivationFormat.MASKED
    assert DeepEPHighThroughputPrepareAndFinalize.activation_format is ActivationFormat.STANDARD


def test_config_checks_and_size_hints():
    Buffer, Config = fake_deep_ep.Buffer, fake_deep_ep.Config
    with pytest.raises(RuntimeError, match="send_tokens < num_max_nvl_chunked_recv"):
        Config(20, 8, 8)
    with pytest.raises(AssertionError, match="even"):
        Buffer.set_num_sms(3)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks"):
        Buffer.get_dispatch_config(3)
    small = Buffer.get_low_latency_rdma_size_hint(16, 2048, 2, 8)
    assert small % 128 == 0 and small > fake_deep_ep._low_latency_layout_bytes(16, 2048, 2, 8)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > small
    config = Buffer.get_dispatch_config(2)
    assert config.get_nvl_buffer_size_hint(4096, 2) % 128 == 0 and config.get_rdma_buffer_size_hint(4096, 2) == 0


def test_any_import_failure_names_how_to_get_deep_ep(monkeypatch, tmp_path):
    """DeepEP's import checks NCCL and initialises its JIT with asserts: those failures get
    the helpful message too."""
    failing_import(monkeypatch, tmp_path, "deep_ep", "Duplicate NCCL runtime found")
    with pytest.raises(ImportError, match=r"(?s)AssertionError: Duplicate NCCL.*tandem\[gpu\]"):
        DeepEPHighThroughputPrepareAndFinalize(NUM_EXPERTS)


def test_low_latency_budget_is_checked_against_deep_ep_limits(monkeypatch):
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    check_low_latency_budget(128, 8)
    check_low_latency_budget(511, 4)
    with pytest.raises(ValueError, match=r"NVSHMEM_QP_DEPTH=1024.*T <= 511"):
        check_low_latency_budget(512, 4)
    with pytest.raises(ValueError, match=r"multiple of 4.*use T=4"):
        check_low_latency_budget(3, 2)
    with pytest.raises(ValueError, match=">= 1"):
        check_low_latency_budget(0, 2)
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "4096")
    check_low_latency_budget(2046, 2)


def test_low_latency_budget_is_the_one_dispatch_budget():
    from tandem.config import ParallelConfig

    # One budget: --dispatch-max-tokens-per-rank (default 128 for DeepEP LL), the old flag an alias.
    assert ParallelConfig(data_parallel_size=2, all2all_backend=LL).dispatch_budget(2048) == 128
    assert ParallelConfig(data_parallel_size=2, all2all_backend=LL, deepep_ll_max_tokens_per_rank=64).dispatch_budget(2048) == 64
    with pytest.raises(ValueError, match="deepep-ll-max-tokens-per-rank=2048"):
        ParallelConfig(data_parallel_size=2, all2all_backend=LL, deepep_ll_max_tokens_per_rank=2048)
    with pytest.raises(ValueError, match="dispatch_max_tokens_per_rank .* 'torch_a2a'"):
        ParallelConfig(data_parallel_size=2, all2all_backend="torch_a2a", deepep_ll_max_tokens_per_rank=2048)


def test_full_graphs_refuse_high_throughput():
    from tandem.config import EngineConfig, OverlapConfig, ParallelConfig
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    with pytest.raises(ValueError, match="graph-mode full cannot capture the deepep_high_throughput"):
        EngineConfig(overlap=OverlapConfig(graph_mode="full"), parallel=ParallelConfig(2, all2all_backend=HT))
    EngineConfig(overlap=OverlapConfig(graph_mode="full"), parallel=ParallelConfig(2, all2all_backend=LL), max_num_batched_tokens=128)

    class Layer(torch.nn.Module):
        def __init__(self, prepare_finalize, experts):
            super().__init__()
            self.kernel = FusedMoEModularKernel(prepare_finalize, experts)

    from tandem.modular_kernels import TorchExperts

    ht = Layer(DeepEPHighThroughputPrepareAndFinalize.__new__(DeepEPHighThroughputPrepareAndFinalize), TorchExperts())
    model = torch.nn.Sequential(ht)
    with pytest.raises(ValueError, match="deepep_high_throughput"):
        UBatchWrapper(model, graph_mode="full")
    UBatchWrapper(model, graph_mode="none")
    ll = DeepEPLowLatencyPrepareAndFinalize.__new__(DeepEPLowLatencyPrepareAndFinalize)
    UBatchWrapper(torch.nn.Sequential(Layer(ll, TorchBatchedExperts())), graph_mode="full")


def test_byte_counts_only_for_a_modelled_fabric_outside_captures(monkeypatch):
    """Counting the bytes reads a device value on the host: never without a fabric to model,
    never inside a graph capture."""
    from tandem.modular_kernels import FabricModel, prepare_deepep

    adapter = DeepEPLowLatencyPrepareAndFinalize.__new__(DeepEPLowLatencyPrepareAndFinalize)

    def host_read():
        raise AssertionError("read a device value on the host")

    adapter.fabric = None
    assert adapter._modelled_bytes(host_read) is None
    adapter.fabric = FabricModel(1e-6, 1e9)
    monkeypatch.setattr(prepare_deepep, "graph_capture_active", lambda: True)
    assert adapter._modelled_bytes(host_read) is None
    monkeypatch.setattr(prepare_deepep, "graph_capture_active", lambda: False)
    assert adapter._modelled_bytes(lambda: 42) == 42


# ------------------------------------------------------------------ stream order (review N1, N4)


def _stream_order_cases(rank, world):
    from tandem.platform import get_platform

    report = {}
    fake_deep_ep.install()
    p = _problem(rank, "random")  # a float32 model: bf16 on DeepEP's side only
    # N1: combine-shared issues the low-latency combine on the comm stream; DeepEP's hook
    # launches the receive there, so the compute stream may only read it after a join that
    # follows the hook (the fake raises on a read that is not ordered after the receive).
    for ubatches in (1, 2):
        kernel = _build(LL, shared_experts=p.shared_experts, enable_sbo=True, sbo_mode="combine-shared")
        try:
            out = run_kernel(kernel, p, rank, world, num_ubatches=ubatches)
            report[f"combine-shared/ubatches={ubatches}"] = bool(
                torch.allclose(out.float(), p.reference(with_shared=True).float(), **BF16_TOL)
            )
        except RuntimeError as exc:
            report[f"combine-shared/ubatches={ubatches}"] = f"{exc}"
        report[f"combine-shared/ubatches={ubatches}/nothing-unjoined"] = get_platform("cpu").pending_streams() == []
    # N4: a 32-bit topk_idx_t build (or fp32 weights from bf16) makes the adapter convert
    # copies; the combine's receive reads them when its hook runs, so they must outlive
    # finalize_async (the fake raises when they were freed first).
    fake_deep_ep.install(topk_idx_dtype=torch.int32)
    release_shared_buffers()
    for ubatches in (1, 2):
        try:
            out = run_kernel(_build(LL), p, rank, world, num_ubatches=ubatches)
            report[f"copies-kept-alive/ubatches={ubatches}"] = _oracle(out, p)
        except RuntimeError as exc:
            report[f"copies-kept-alive/ubatches={ubatches}"] = f"{exc}"
    return report


@pytest.mark.slow
def test_low_latency_receives_follow_stream_order_and_lifetimes():
    """Review N1 and N4 on the stream-ordered fake: the hook before the join in SBO
    combine-shared, and the converted top-k copies alive until the combine's receive ran."""
    per_rank = run_distributed(_stream_order_cases, 2, timeout_s=200)
    for report in per_rank:
        assert {k: v for k, v in report.items() if v is not True} == {}


def test_full_graphs_refuse_host_syncing_backends():
    """Review N7: the defaults (local or torch_a2a with the standard torch experts) sync on the
    host, so `--graph-mode full` refuses them at configuration and at wrapper construction,
    naming the backend, instead of failing at the first capture."""
    from tandem.config import EngineConfig, OverlapConfig, ParallelConfig
    from tandem.modular_kernels import TorchExperts
    from tandem.modular_kernels.prepare_local import LocalPrepareAndFinalize
    from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize
    from tandem.worker.ubatch_wrapper import UBatchWrapper

    full = OverlapConfig(graph_mode="full")
    with pytest.raises(ValueError, match="cannot capture the torch moe backend in the standard layout.*nonzero"):
        EngineConfig(overlap=full)  # local + torch: the defaults on one rank
    with pytest.raises(ValueError, match="torch_a2a all2all backend.*tolist"):
        EngineConfig(overlap=full, parallel=ParallelConfig(2, moe_backend="triton"))  # torch_a2a: the dp>1 default
    EngineConfig(overlap=full, parallel=ParallelConfig(moe_backend="triton"))
    EngineConfig(overlap=full, parallel=ParallelConfig(2, all2all_backend="torch_a2a_ll"))  # masked torch experts

    class Layer(torch.nn.Module):
        def __init__(self, prepare_finalize, experts):
            super().__init__()
            self.kernel = FusedMoEModularKernel(prepare_finalize, experts)

    with pytest.raises(ValueError, match="torch moe backend"):
        UBatchWrapper(torch.nn.Sequential(Layer(LocalPrepareAndFinalize(NUM_EXPERTS), TorchExperts())), graph_mode="full")
    a2a = TorchAllToAllPrepareAndFinalize.__new__(TorchAllToAllPrepareAndFinalize)
    with pytest.raises(ValueError, match="torch_a2a all2all backend"):
        UBatchWrapper(torch.nn.Sequential(Layer(a2a, TorchExperts())), graph_mode="full")


def _hidden_and_build_cases(rank, world):
    fake_deep_ep.install()
    release_shared_buffers()
    report = {}
    # N2: a hidden size DeepEP LL has no kernels for is refused when the model is built.
    report["hidden-3584"] = _raises(
        lambda: build_moe_kernel(LL, "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=3584),
        ValueError, "hidden size 3584 is not one DeepEP's low-latency kernels are built for (2048, 2560",
    )
    # N5: the Buffer exists once the kernel is built, before any (ubatched) forward.
    kernel = _build(LL)
    report["buffer-at-build"] = kernel.prepare_finalize.buffer is not None
    return report


@pytest.mark.slow
def test_low_latency_hidden_size_and_buffer_are_settled_at_model_build():
    per_rank = run_distributed(_hidden_and_build_cases, 2, timeout_s=120)
    for report in per_rank:
        assert {k: v for k, v in report.items() if v is not True} == {}


def test_low_latency_step_budget_is_checked_at_configuration():
    """Review N3: a step above the per-rank budget would fail at dispatch; refused up front."""
    from tandem.config import EngineConfig, ParallelConfig

    with pytest.raises(ValueError, match="--max-num-batched-tokens 2048 exceeds --dispatch-max-tokens-per-rank 128"):
        EngineConfig(parallel=ParallelConfig(2, all2all_backend=LL))
    EngineConfig(parallel=ParallelConfig(2, all2all_backend=LL), max_num_batched_tokens=128)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_with_low_latency_buffers_stops_the_engine(overlap, monkeypatch):
    """Review N8: after a step fails part-way, DeepEP's low-latency double-buffer parity is out
    of step with the peers and the captured graphs, so the engine must not serve on: the
    failed step's requests, every request it still holds and every later one get an error
    naming the backend. (tiny-moe runs the local backend here, its kernel marked as DeepEP
    LL's is: DeepEP LL cannot run tiny-moe's hidden size.)"""
    from tandem.config import OverlapConfig, SchedulerConfig
    from tandem.models.tiny_moe import build_tiny_moe
    from tandem.engine.core import Engine
    from tandem.worker.model_runner import ModelRunner
    from tandem.worker.sampling import SamplingParams

    info = build_tiny_moe()
    kernels = [m for layer in info.model.modules() for m in vars(layer).values() if isinstance(m, FusedMoEModularKernel)]
    assert kernels
    monkeypatch.setattr(kernels[0].prepare_finalize, "survives_failed_step", False, raising=False)
    runner = ModelRunner(info, overlap=OverlapConfig(), num_kv_blocks=64, block_size=4)
    engine = Engine(runner, SchedulerConfig(max_num_seqs=4, overlap_schedule=overlap), max_num_batched_tokens=32)
    real_execute, calls = runner.execute, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a ubatch failed mid-layer")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fails_once)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(2):
        assert engine.add_request(f"r{i}", [1, 2, 3, 4 + i], params) is None
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_work:
            break
    assert set(finished) == {"r0", "r1"} and all(o.finish_reason == "error" for o in finished.values())
    late = engine.add_request("late", [5, 6], params)
    assert late is not None and late.finish_reason == "error"
    assert "engine stopped" in late.error and "local" in late.error and "restart" in late.error
    engine.close()


def test_the_stall_watchdog_cannot_fire_during_the_cold_start(monkeypatch):
    """Review N5: the first ubatched run of each ubatch count compiles and initialises
    libraries between two yields; its watchdog limit is the cold-start one, later runs get
    the normal limit."""
    from tandem.contexts import ForwardContext, set_forward_context
    from tandem.worker import ubatch_wrapper
    from tandem.ubatch import split_by_tokens

    seen = []
    real = ubatch_wrapper.make_ubatch_contexts

    def recording(*args, **kwargs):
        seen.append((args[0], kwargs["timeout"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ubatch_wrapper, "make_ubatch_contexts", recording)

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    wrapper = ubatch_wrapper.UBatchWrapper(Double(), num_ubatches=3, executor="greenlet", timeout=5.0)
    x = torch.arange(6.0)
    for n in (2, 2, 3, 3):
        with set_forward_context(ForwardContext(ubatch_slices=split_by_tokens([1] * 6, n))):
            assert torch.equal(wrapper(x), x * 2)
    cold = ubatch_wrapper.COLD_START_TIMEOUT_S
    assert seen == [(2, cold), (2, 5.0), (3, cold), (3, 5.0)] and cold >= 600


# ------------------------------------------------------------------ UE8M0 dispatch for DeepGEMM on SM100 (gpu-review-2 N10)


def _relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _ue8m0_cases(rank, world):
    from tandem.modular_kernels import experts_deep_gemm
    from tandem.testing import fake_deep_gemm

    fake_deep_ep.install()
    fake_deep_gemm.install(arch_major=9)
    inter = 128  # DeepGEMM's fp8 block
    p = make_problem(rank, "random", num_tokens=MAX_TOKENS, hidden=HIDDEN, intermediate=inter)
    p.hidden = p.hidden.to(torch.bfloat16)
    oracle = p.reference()

    def build(moe):
        return build_moe_kernel(
            LL, moe, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, use_fp8_dispatch=True,
            **dispatch_budget(LL, MAX_TOKENS),
        )

    kernel = build("deep_gemm")
    buffer = kernel.prepare_finalize.ensure_buffer(HIDDEN)
    dispatched = []
    real_dispatch = buffer.low_latency_dispatch

    def recorded(*args, **kwargs):
        dispatched.append((kwargs.get("round_scale"), kwargs.get("use_ue8m0")))
        recv, *rest = real_dispatch(*args, **kwargs)
        dispatched.append(recv[1].dtype)
        return (recv, *rest)

    buffer.low_latency_dispatch = recorded
    quantized = []
    real_quantize = experts_deep_gemm.quantize_fp8_per_token_group
    experts_deep_gemm.quantize_fp8_per_token_group = lambda x, *a, **k: quantized.append(x.shape) or real_quantize(x, *a, **k)
    report = {}

    experts_deep_gemm._arch_major = lambda device: 9
    sm90 = run_kernel(kernel, p, rank, world)
    report["sm90-float32-scales"] = dispatched == [(False, False), torch.float32]
    dispatched.clear()
    quantized.clear()

    fake_deep_gemm.install(arch_major=10)
    experts_deep_gemm._arch_major = lambda device: 10
    sm100 = run_kernel(kernel, p, rank, world)
    # DeepGEMM on SM100: power-of-two scales packed as UE8M0, handed to the GEMM as they are
    # (the only quantization the experts do is the intermediate activation's).
    report["sm100-asks-for-ue8m0"] = dispatched == [(True, True), torch.int32]
    report["sm100-no-requantization"] = quantized == [(NUM_EXPERTS // world, 128, inter)]  # M = R*T padded to 128
    report["sm100-weights-packed-once"] = fake_deep_gemm.SF_TRANSFORMS["rhs"] == 2
    report["sm100-oracle"] = _relative(sm100, oracle) < 8e-2
    report["sm90-oracle"] = _relative(sm90, oracle) < 8e-2
    again = run_kernel(kernel, p, rank, world, num_ubatches=2)
    # run_kernel slices new views of the weights: packed once for them, not once per ubatch.
    report["sm100-dbo"] = _relative(again, oracle) < 8e-2 and fake_deep_gemm.SF_TRANSFORMS["rhs"] == 4
    dispatched.clear()
    # Experts that cannot read UE8M0 (torch) keep float32 scales, on SM100 too.
    torch_kernel = build("torch")
    run_kernel(torch_kernel, p, rank, world)
    report["torch-experts-float32"] = dispatched == [(False, False), torch.float32]
    return report


@pytest.mark.slow
def test_deep_gemm_on_sm100_gets_ue8m0_scales_from_low_latency_dispatch():
    per_rank = run_distributed(_ue8m0_cases, 2, timeout_s=150)
    assert_every_case_passed(per_rank, 8)
