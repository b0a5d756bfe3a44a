"""torch_a2a on gloo issues its collectives from one issuer thread per process group; the
direct path (no issuer) must give identical results, under DBO too."""

import torch
import torch.distributed as dist

from tandem.modular_kernels import FusedMoEModularKernel
from tandem.modular_kernels.experts_torch import TorchExperts
from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize, _issuer_for
from tandem.testing import run_distributed
from tests.modular_kernels.moe_cases import NUM_EXPERTS, make_problem, run_kernel


def _issued_vs_direct(rank, world):
    assert _issuer_for(None) is _issuer_for(dist.group.WORLD)
    issued_pf = TorchAllToAllPrepareAndFinalize(NUM_EXPERTS)
    direct_pf = TorchAllToAllPrepareAndFinalize(NUM_EXPERTS, issue_thread=False)
    assert issued_pf._issuer is not None and direct_pf._issuer is None
    issued = FusedMoEModularKernel(issued_pf, TorchExperts())
    direct = FusedMoEModularKernel(direct_pf, TorchExperts())
    out = {}
    for routing in ("random", "masked"):
        p = make_problem(rank, routing, num_tokens=13)
        ref = run_kernel(direct, p, rank, world)
        out[routing] = [
            torch.equal(run_kernel(issued, p, rank, world), ref),
            torch.equal(run_kernel(issued, p, rank, world, num_ubatches=2), run_kernel(direct, p, rank, world, num_ubatches=2)),
            torch.equal(run_kernel(issued, p, rank, world, num_ubatches=2, executor="greenlet"), run_kernel(direct, p, rank, world, num_ubatches=2, executor="greenlet")),
        ]
        out[routing + "-vs-oracle"] = float((ref - p.reference()).abs().max())
    return out


def test_issuer_thread_gives_the_direct_results_with_and_without_dbo():
    for result in run_distributed(_issued_vs_direct, 2):
        assert result["random"] == [True, True, True] and result["masked"] == [True, True, True]
        assert result["random-vs-oracle"] < 1e-4 and result["masked-vs-oracle"] < 1e-4
