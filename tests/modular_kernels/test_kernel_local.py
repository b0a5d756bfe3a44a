import pytest
import torch

from tandem.contexts import dbo_current_ubatch_id, run_ubatches
from tandem.modular_kernels import (
    ActivationFormat,
    FusedMoEModularKernel,
    LocalPrepareAndFinalize,
    TorchBatchedExperts,
    TorchExperts,
    build_moe_kernel,
    dequantize_fp8,
    quantize_fp8_per_token_group,
    torch_moe_reference,
)
from tests.support.moe_cases import HIDDEN, NUM_EXPERTS, TOP_K, RecordingPrepareFinalize, make_problem, run_kernel


def local_kernel(**kwargs):
    return build_moe_kernel("local", "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **kwargs)


@pytest.mark.parametrize("routing", ["random", "one_expert", "masked", "empty"])
def test_local_torch_matches_the_oracle(routing):
    p = make_problem(0, routing)
    torch.testing.assert_close(run_kernel(local_kernel(), p, 0, 1), p.reference(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("executor", ["thread", "greenlet"])
@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_dbo_equals_no_dbo_with_shared_experts(executor, num_ubatches):
    p = make_problem(0, "random")
    kernel = local_kernel(shared_experts=p.shared_experts)
    plain = run_kernel(kernel, p, 0, 1)
    torch.testing.assert_close(plain, p.reference(with_shared=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run_kernel(kernel, p, 0, 1, num_ubatches=num_ubatches, executor=executor), plain)


def test_fp8_dispatch_equals_the_oracle_on_dequantized_input():
    p = make_problem(0, "random")
    out = run_kernel(local_kernel(use_fp8_dispatch=True), p, 0, 1)
    roundtrip = dequantize_fp8(*quantize_fp8_per_token_group(p.hidden), torch.float32)
    expected = torch_moe_reference(roundtrip, p.w1, p.w2, p.topk_weights, p.topk_ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # ...and fp8 stays close to the full-precision result (e4m3 keeps 3 mantissa bits).
    assert (out - p.reference()).norm() / p.reference().norm() < 0.06


def test_quantization_roundtrip_error_is_bounded_per_group():
    x = torch.randn(4, 256) * torch.logspace(-3, 3, 256)
    q, scales = quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (4, 2)
    err = (dequantize_fp8(q, scales, torch.float32) - x).abs()
    assert torch.all(err <= x.abs() * 2**-3 + scales.repeat_interleave(128, dim=1) * 2**-6)


def test_sync_backend_under_dbo_yields_in_schedule():
    trace = []
    p = make_problem(0, "random")
    kernel = local_kernel()
    kernel.prepare_finalize = RecordingPrepareFinalize(kernel.prepare_finalize, trace)
    original = kernel.experts.apply

    def recorded_apply(tokens, w1, w2):
        trace.append(("experts", dbo_current_ubatch_id()))
        return original(tokens, w1, w2)

    kernel.experts.apply = recorded_apply
    run_kernel(kernel, p, 0, 1, num_ubatches=2)
    # The local backend has nothing to receive, but each ubatch still yields after each
    # send, and the next ubatch completes the previous one's transfer before its own send.
    assert trace == [
        ("send_dispatch", 0),
        ("recv_dispatch", 0, "by", 1),
        ("send_dispatch", 1),
        ("experts", 0),
        ("recv_dispatch", 1, "by", 0),
        ("send_combine", 0),
        ("experts", 1),
        ("recv_combine", 0, "by", 1),
        ("send_combine", 1),
        ("recv_combine", 1, "by", 0),  # ubatch 0 runs it as it exits
    ]


def test_shared_experts_run_where_asked():
    p = make_problem(0, "random")
    for mode, expected in (("dispatch-shared", ["send_dispatch", "shared", "send_combine"]),
                           ("combine-shared", ["send_dispatch", "send_combine", "shared"]),
                           ("auto", ["send_dispatch", "shared", "send_combine"])):
        trace = []

        def shared(x):
            trace.append(("shared", dbo_current_ubatch_id()))
            return p.shared_experts(x)

        kernel = local_kernel(shared_experts=shared, enable_sbo=True, sbo_mode=mode)
        kernel.prepare_finalize = RecordingPrepareFinalize(kernel.prepare_finalize, trace)
        run_kernel(kernel, p, 0, 1, num_ubatches=2)
        steps = [name for name, owner, *_ in trace if owner == 0 and name in ("send_dispatch", "shared", "send_combine")]
        assert steps == expected
    with pytest.raises(ValueError, match="sbo_mode must be one of"):
        local_kernel(sbo_mode="attention")
    with pytest.raises(ValueError, match="which the 'local' all2all backend cannot do"):
        local_kernel(sbo_mode="combine-down-gemm")


def test_format_mismatch_is_rejected_at_construction():
    with pytest.raises(ValueError, match="standard activations but 'torch' experts \\(TorchBatchedExperts\\) take masked"):
        FusedMoEModularKernel(LocalPrepareAndFinalize(NUM_EXPERTS), TorchBatchedExperts())
    assert TorchExperts().activation_format is ActivationFormat.STANDARD


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(w1=a["w1"][:, :, :-1]), "w1 must be"),
        (lambda a: a.update(w2=a["w2"][:, :-1]), "w2 must be"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:-1]), "topk_ids"),
        (lambda a: a.update(hidden_states=a["hidden_states"][0]), "hidden_states"),
    ],
)
def test_bad_shapes_are_named(change, message):
    p = make_problem(0, "random")
    args = dict(hidden_states=p.hidden, w1=p.w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids)
    change(args)
    with pytest.raises(ValueError, match=message):
        local_kernel()(**args)


@pytest.mark.parametrize(
    "args, message",
    [
        (("nccl_magic", "torch"), "unknown all2all backend 'nccl_magic'"),
        (("local", "cutlass"), "unknown moe backend 'cutlass'"),
        (("torch_a2a", "torch"), "initialised torch.distributed"),
    ],
)
def test_factory_names_bad_choices(args, message):
    with pytest.raises(ValueError, match=message):
        build_moe_kernel(*args, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN)


def test_factory_rejects_fp8_with_odd_hidden_size():
    with pytest.raises(ValueError, match="divisible by 128"):
        build_moe_kernel("local", "torch", num_experts=4, top_k=1, hidden_size=96, use_fp8_dispatch=True)


def test_kernel_runs_inside_run_ubatches_with_per_ubatch_token_slices():
    p = make_problem(0, "random", num_tokens=9)
    kernel = local_kernel()
    outs = run_ubatches(
        [lambda: kernel(p.hidden[:5], p.w1, p.w2, p.topk_weights[:5], p.topk_ids[:5]),
         lambda: kernel(p.hidden[5:], p.w1, p.w2, p.topk_weights[5:], p.topk_ids[5:])]
    )
    assert [o.shape[0] for o in outs] == [5, 4]
    torch.testing.assert_close(torch.cat(outs), p.reference(), atol=1e-5, rtol=1e-5)
