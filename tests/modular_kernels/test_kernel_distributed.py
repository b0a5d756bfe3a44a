"""Every dispatch backend × expert backend against the oracle on real gloo process groups."""

import pytest
import torch

from tandem.contexts import dbo_current_ubatch_id, run_ubatches
from tandem.modular_kernels import build_moe_kernel, dequantize_fp8, quantize_fp8_per_token_group, torch_moe_reference
from tandem.testing import run_distributed
from tests.support.moe_cases import (
    dispatch_budget,
    HIDDEN,
    NUM_EXPERTS,
    TOP_K,
    RecordingPrepareFinalize,
    make_problem,
    run_kernel,
)

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

PAIRS = [("torch_a2a", "torch"), ("torch_a2a_ll", "torch")]


def _build(all2all, moe, **kwargs):
    return build_moe_kernel(
        all2all, moe, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **dispatch_budget(all2all, 16), **kwargs
    )


def _max_err(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _all_cases(rank, world, pairs):
    errors = {}
    for all2all, moe in pairs:
        kernel = _build(all2all, moe)
        for routing in ("random", "one_expert", "masked"):
            p = make_problem(rank, routing)
            errors[f"{all2all}+{moe}/{routing}"] = _max_err(run_kernel(kernel, p, rank, world), p.reference())
        # Rank 1 has no tokens this step; rank 0 still routes to rank 1's experts.
        p = make_problem(rank, "empty" if rank == 1 else "random")
        errors[f"{all2all}+{moe}/rank1-empty"] = _max_err(run_kernel(kernel, p, rank, world), p.reference())

        p = make_problem(rank, "random", num_tokens=13)
        plain = run_kernel(kernel, p, rank, world)
        for executor in ("thread", "greenlet"):
            for n in (2, 3):
                dbo = run_kernel(kernel, p, rank, world, num_ubatches=n, executor=executor)
                errors[f"{all2all}+{moe}/dbo{n}-{executor}-vs-plain"] = _max_err(dbo, plain)

        shared = _build(all2all, moe, shared_experts=p.shared_experts)
        sbo = _build(all2all, moe, shared_experts=p.shared_experts, enable_sbo=True)
        with_shared = run_kernel(shared, p, rank, world)
        errors[f"{all2all}+{moe}/shared-vs-oracle"] = _max_err(with_shared, p.reference(with_shared=True))
        errors[f"{all2all}+{moe}/sbo-vs-no-sbo"] = _max_err(run_kernel(sbo, p, rank, world), with_shared)
        errors[f"{all2all}+{moe}/sbo+dbo-vs-no-sbo"] = _max_err(run_kernel(sbo, p, rank, world, num_ubatches=2), with_shared)
        at_dispatch = _build(all2all, moe, shared_experts=p.shared_experts, enable_sbo=True, sbo_mode="dispatch-shared")
        errors[f"{all2all}+{moe}/sbo@dispatch-vs-no-sbo"] = _max_err(run_kernel(at_dispatch, p, rank, world), with_shared)
        errors[f"{all2all}+{moe}/dbo-shared@dispatch-vs-no-sbo"] = _max_err(
            run_kernel(at_dispatch, p, rank, world, num_ubatches=2), with_shared
        )

        fp8 = _build(all2all, moe, use_fp8_dispatch=True)
        roundtrip = dequantize_fp8(*quantize_fp8_per_token_group(p.hidden), torch.float32)
        expected = torch_moe_reference(roundtrip, p.w1, p.w2, p.topk_weights, p.topk_ids)
        errors[f"{all2all}+{moe}/fp8-vs-dequantized-oracle"] = _max_err(run_kernel(fp8, p, rank, world), expected)
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_every_pair_matches_the_oracle(world):
    per_rank = run_distributed(_all_cases, world, PAIRS, timeout_s=240)
    bad = {(rank, case): err for rank, errors in enumerate(per_rank) for case, err in errors.items() if err > 2e-5}
    assert bad == {}
    assert len(per_rank[0]) == len(PAIRS) * 14


def _random_only(rank, world, pairs):
    out = {}
    for all2all, moe in pairs:
        p = make_problem(rank, "random", num_tokens=7)
        out[all2all] = _max_err(run_kernel(_build(all2all, moe), p, rank, world, num_ubatches=2), p.reference())
    return out


def test_four_ranks():
    per_rank = run_distributed(_random_only, 4, PAIRS, timeout_s=240)
    assert all(err <= 2e-5 for errors in per_rank for err in errors.values()), per_rank


def _schedule(rank, world, all2all):
    trace = []
    kernel = _build(all2all, "torch")
    kernel.prepare_finalize = RecordingPrepareFinalize(kernel.prepare_finalize, trace)
    p = make_problem(rank, "random")
    w1, w2 = p.local_weights(rank, world)

    def ubatch(lo, hi):
        def body():
            trace.append(("attention", dbo_current_ubatch_id()))
            kernel(p.hidden[lo:hi], w1, w2, p.topk_weights[lo:hi], p.topk_ids[lo:hi])

        return body

    run_ubatches([ubatch(0, 6), ubatch(6, 12)])
    return trace


@pytest.mark.parametrize("all2all", ["torch_a2a", "torch_a2a_ll"])
def test_dbo_follows_the_vllm_schedule(all2all):
    traces = run_distributed(_schedule, 2, all2all, timeout_s=120)
    expected = [
        ("attention", 0),
        ("send_dispatch", 0),
        ("attention", 1),  # ubatch 1 queues its own compute first...
        ("recv_dispatch", 0, "by", 1),  # ...then issues ubatch 0's receive
        ("send_dispatch", 1),
        ("recv_dispatch", 1, "by", 0),
        ("send_combine", 0),
        ("recv_combine", 0, "by", 1),
        ("send_combine", 1),
        ("recv_combine", 1, "by", 0),
    ]
    assert traces == [expected, expected]
