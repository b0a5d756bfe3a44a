"""SBO in SGLang's three modes: every mode equals the oracle on 2 gloo ranks, with DBO on
and off and through the stage executor's steps; combine-down-gemm sends each block before
the next one computes; `auto` picks per backend."""

import pytest
import torch

from tandem.modular_kernels import SBO_MODES, TorchBatchedExperts, TorchExperts, build_moe_kernel
from tandem.modular_kernels.interfaces import ExpertTokens
from tandem.modular_kernels.sbo import resolve_sbo_mode
from tandem.contexts import current_ubatch_context
from tandem.platform import get_platform
from tandem.testing import run_distributed
from tests.support.moe_cases import dispatch_budget, HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K, make_problem, run_kernel

BACKENDS = ("torch_a2a", "torch_a2a_ll")


def _build(all2all, **kwargs):
    return build_moe_kernel(
        all2all, "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **dispatch_budget(all2all, 16), **kwargs
    )


def _err(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _steps(kernel, p, rank, world):
    """Two ubatches through the steps as the stage executor runs them (B two steps
    behind A), the shared experts where SGLang's decode strategy puts them."""
    w1, w2 = p.local_weights(rank, world)
    halves = [slice(0, 6), slice(6, None)]
    states = [None, None]
    steps = [
        lambda i: states.__setitem__(
            i, kernel.dispatch_prepare(p.hidden[halves[i]], w1, w2, p.topk_weights[halves[i]], p.topk_ids[halves[i]])
        ),
        lambda i: kernel.dispatch_send(states[i]),
        lambda i: kernel.compute_shared(states[i]),
        lambda i: kernel.dispatch_recv(states[i]),
        lambda i: kernel.compute_experts(states[i]),
        lambda i: kernel.combine_send(states[i]),
        lambda i: kernel.combine_recv(states[i]),
    ]
    for ub, s in sorted(((ub, s) for ub in (0, 1) for s in range(len(steps))), key=lambda us: (us[1] + 2 * us[0], us[0])):
        steps[s](ub)
    return torch.cat([kernel.output(states[0]), kernel.output(states[1])])


def _every_mode(rank, world):
    """Errors of every case, and the block order of combine-down-gemm per backend (one
    launch of the ranks for both: starting them is the slow part)."""
    errors = {}
    for all2all in BACKENDS:
        for routing in ("random", "masked", "empty"):
            p = make_problem(rank, "empty" if routing == "empty" and rank == 1 else routing, num_tokens=13)
            expected = p.reference(with_shared=True)
            for mode in SBO_MODES:
                kernel = _build(all2all, shared_experts=p.shared_experts, enable_sbo=True, sbo_mode=mode)
                errors[f"{all2all}/{routing}/{mode}"] = _err(run_kernel(kernel, p, rank, world), expected)
                if routing != "random":
                    continue
                for executor in ("thread", "greenlet"):
                    dbo = run_kernel(kernel, p, rank, world, num_ubatches=2, executor=executor)
                    errors[f"{all2all}/{mode}/dbo-{executor}"] = _err(dbo, expected)
                errors[f"{all2all}/{mode}/steps"] = _err(_steps(kernel, p, rank, world), expected)
    orders = {}
    for all2all in BACKENDS:
        orders[all2all], errors[f"{all2all}/recorded-blocks"] = _block_order(rank, world, all2all)
    return errors, orders


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_every_mode, 2, timeout_s=240)


@pytest.mark.slow
def test_every_mode_matches_the_oracle_on_two_ranks_with_and_without_dbo(two_ranks):
    bad = {(rank, case): err for rank, (errors, _) in enumerate(two_ranks) for case, err in errors.items() if err > 2e-5}
    assert bad == {}
    assert len(two_ranks[0][0]) == len(BACKENDS) * (len(SBO_MODES) * (3 + 3) + 1)


class _RecordingExperts:
    def __init__(self, inner, trace):
        self._inner, self._trace = inner, trace

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def apply_blocks(self, tokens, w1, w2, blocks):
        for index, out in self._inner.apply_blocks(tokens, w1, w2, blocks):
            self._trace.append(("computed", index))
            yield index, out


def _block_order(rank, world, all2all):
    trace = []
    p = make_problem(rank, "random", num_tokens=13)
    kernel = _build(all2all, shared_experts=p.shared_experts, enable_sbo=True, sbo_mode="combine-down-gemm")
    kernel.experts = _RecordingExperts(kernel.experts, trace)
    pf = kernel.prepare_finalize
    inner_blocks = pf.finalize_in_blocks

    def recording_blocks(*args, **kwargs):
        combine = inner_blocks(*args, **kwargs)
        send = combine.send
        # Each block leaves on the comm stream (the compute stream is the default one here).
        on_comm = lambda: get_platform("cpu").current_stream() is not get_platform("cpu").default_stream  # noqa: E731
        combine.send = lambda index, out: (trace.append(("sent", index, on_comm())), send(index, out))[1]
        return combine

    pf.finalize_in_blocks = recording_blocks
    out = run_kernel(kernel, p, rank, world)
    return trace, _err(out, p.reference(with_shared=True))


@pytest.mark.slow
def test_combine_down_gemm_sends_each_block_before_computing_the_next(two_ranks):
    local_experts = NUM_EXPERTS // 2  # one block per local expert on both backends
    expected = [step for i in range(local_experts) for step in (("computed", i), ("sent", i, True))]
    assert [orders for _, orders in two_ranks] == [{all2all: expected for all2all in BACKENDS}] * 2


@pytest.mark.parametrize("experts, blocks", [
    (TorchExperts(), [torch.tensor([3, 0, 7]), torch.tensor([1, 2]), torch.tensor([], dtype=torch.long),
                      torch.tensor([4, 5, 6, 8, 9])]),
    (TorchBatchedExperts(), [slice(0, 1), slice(1, 3), slice(3, 4)]),
])
def test_apply_blocks_equals_apply_on_each_block(experts, blocks):
    g = torch.Generator().manual_seed(3)
    E, H, I = 4, HIDDEN, INTERMEDIATE
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    if isinstance(experts, TorchExperts):
        ids = torch.randint(-1, E, (10, TOP_K), generator=g)
        tokens = ExpertTokens(torch.randn(10, H, generator=g), None, torch.float32, topk_ids=ids,
                              topk_weights=torch.rand(10, TOP_K, generator=g))
        whole = experts.apply(tokens, w1, w2)
        parts = [whole[rows] for rows in blocks]
    else:
        counts = torch.tensor([3, 0, 5, 8])
        tokens = ExpertTokens(torch.randn(E, 8, H, generator=g), None, torch.float32, expert_num_tokens=counts)
        whole = experts.apply(tokens, w1, w2)
        parts = [whole[sl] for sl in blocks]
    got = list(experts.apply_blocks(tokens, w1, w2, blocks))
    assert [i for i, _ in got] == list(range(len(blocks)))
    for (_, out), expected in zip(got, parts):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_auto_picks_per_backend_as_sglang():
    class _PF:
        def __init__(self, blocks):
            self.supports_block_combine = lambda: blocks

    cpu = torch.device("cpu")
    assert resolve_sbo_mode("auto", _PF(True), TorchExperts(), cpu) == "combine-down-gemm"
    # Experts that would rerun the whole MLP per block (DeepGEMM, Triton here): no down-GEMM overlap.
    slow = type("Slow", (), {"blocks_down_projection": False})()
    assert resolve_sbo_mode("auto", _PF(True), slow, cpu) == "dispatch-shared"
    assert resolve_sbo_mode("auto", _PF(False), TorchExperts(), cpu) == "dispatch-shared"
    assert resolve_sbo_mode("combine-shared", _PF(True), TorchExperts(), cpu) == "combine-shared"


def test_combine_shared_sends_on_the_comm_stream_and_computes_on_the_compute_stream():
    p = make_problem(0, "random")
    seen = []

    def where(what):
        ctx = current_ubatch_context()
        stream = get_platform("cpu").current_stream()
        seen.append((what, "comm" if stream is ctx.comm_stream else "compute" if stream is ctx.compute_stream else "?"))

    def shared(x):
        where("shared")
        return p.shared_experts(x)

    kernel = build_moe_kernel("local", "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                              shared_experts=shared, enable_sbo=True, sbo_mode="combine-shared")
    finalize = kernel.prepare_finalize.finalize_async
    kernel.prepare_finalize.finalize_async = lambda *a, **k: (where("combine"), finalize(*a, **k))[1]
    out = run_kernel(kernel, p, 0, 1, num_ubatches=2, executor="greenlet")
    torch.testing.assert_close(out, p.reference(with_shared=True), atol=1e-5, rtol=1e-5)
    assert seen == [("combine", "comm"), ("shared", "compute")] * 2
