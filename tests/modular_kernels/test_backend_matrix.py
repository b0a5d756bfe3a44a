"""Every --all2all-backend × --moe-backend pair of the same activation format, built by
`build_moe_kernel` on 2 gloo ranks, against the oracle, with and without DBO.

GPU-only pieces run on their CPU stand-ins: Triton under TRITON_INTERPRET=1, DeepEP and
DeepGEMM through `tandem.testing`'s emulations of their Python APIs."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, here and in the spawned ranks

import pytest
import torch

from tandem.modular_kernels import ALL2ALL_BACKENDS, MOE_BACKENDS, build_moe_kernel
from tandem.testing import run_distributed
from tests.support.moe_cases import dispatch_budget, NUM_EXPERTS, TOP_K, make_problem, run_kernel

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

pytest.importorskip("triton")

HIDDEN, INTERMEDIATE, TOKENS = 2048, 128, 6  # DeepEP LL's smallest hidden size; DeepGEMM's 128 alignment
#: Relative error of the single-rank kernel against the float32 oracle: DeepGEMM computes
#: in fp8 (activations, weights and the intermediate), the others in float32.
ORACLE_TOLERANCE = {"torch": 1e-5, "triton": 1e-5, "deep_gemm": 8e-2}
#: Relative error of each expert-parallel pair against the same experts on one rank; DeepEP
#: moves bf16 only, so its pairs see the float32 model's tokens rounded to bf16.
PAIR_TOLERANCE = {"torch": 1e-5, "triton": 1e-5, "deep_gemm": 1e-2}
DEEPEP_TOLERANCE = 1e-2
COMMUNICATING = sorted(set(ALL2ALL_BACKENDS) - {"local"})


def _relative_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _matrix(rank, world):
    from tandem.testing import fake_deep_ep, fake_deep_gemm

    fake_deep_ep.install()  # bf16-only, as DeepEP: the adapters cast at their boundary
    fake_deep_gemm.install()
    p = make_problem(rank, "masked", num_tokens=TOKENS, hidden=HIDDEN, intermediate=INTERMEDIATE)
    oracle = p.reference()
    report = {}
    for moe in sorted(MOE_BACKENDS):
        single = build_moe_kernel("local", moe, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN)
        ref = run_kernel(single, p, 0, 1)
        report[("local", moe, "oracle")] = _relative_error(ref, oracle)
        for all2all in COMMUNICATING:
            kernel = build_moe_kernel(
                all2all, moe, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **dispatch_budget(all2all, TOKENS)
            )
            report[(all2all, moe, "plain")] = _relative_error(run_kernel(kernel, p, rank, world), ref)
            report[(all2all, moe, "dbo")] = _relative_error(run_kernel(kernel, p, rank, world, num_ubatches=2), ref)
    return report


def _tolerance(all2all: str, moe: str, _mode: str) -> float:
    if all2all == "local":
        return ORACLE_TOLERANCE[moe]
    if all2all.startswith("deepep"):
        # bf16 tokens: DeepGEMM's fp8 casts then round other inputs than on one rank, so
        # the pair is another fp8 pipeline (the oracle's tolerance), the others bf16-close.
        return ORACLE_TOLERANCE[moe] if moe == "deep_gemm" else DEEPEP_TOLERANCE
    return PAIR_TOLERANCE[moe]


def test_every_pair_on_two_ranks():
    per_rank = run_distributed(_matrix, 2, timeout_s=600)
    for report in per_rank:
        assert len(report) == len(MOE_BACKENDS) * (1 + 2 * len(COMMUNICATING))
        too_far = {key: err for key, err in report.items() if err > _tolerance(*key)}
        assert too_far == {}
