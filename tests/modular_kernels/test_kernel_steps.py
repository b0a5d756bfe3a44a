"""The kernel as SGLang's steps: the same result as `forward`, in any interleaving of
ubatches that keeps each one's step order, and a clear error when a step is skipped."""

import pytest
import torch

from tandem.modular_kernels import MoEStepState, build_moe_kernel
from tandem.testing import run_distributed
from tests.support.moe_cases import dispatch_budget, HIDDEN, NUM_EXPERTS, TOP_K, make_problem


def _build(all2all="local", **kwargs):
    return build_moe_kernel(
        all2all, "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, **dispatch_budget(all2all, 16), **kwargs
    )


def _inputs(p, rank=0, world=1, rows=slice(None)):
    w1, w2 = p.local_weights(rank, world)
    return p.hidden[rows], w1, w2, p.topk_weights[rows], p.topk_ids[rows]


def _send(kernel, *inputs) -> MoEStepState:
    state = kernel.dispatch_prepare(*inputs)
    kernel.dispatch_send(state)
    return state


def _run_steps(kernel, state: MoEStepState) -> torch.Tensor:
    kernel.dispatch_recv(state)
    kernel.compute_experts(state)
    kernel.combine_send(state)
    kernel.combine_recv(state)
    return kernel.output(state)


def test_steps_in_order_equal_forward_with_shared_experts():
    p = make_problem(0, "random")
    kernel = _build(shared_experts=p.shared_experts)
    state = _send(kernel, *_inputs(p))
    assert isinstance(state, MoEStepState) and state.tokens is None
    out = _run_steps(kernel, state)
    torch.testing.assert_close(out, kernel(*_inputs(p)))
    torch.testing.assert_close(out, p.reference(with_shared=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.routed_output + state.shared_output, out)


def test_compute_shared_runs_the_shared_experts_once():
    p = make_problem(0, "random")
    calls = []

    def shared(x):
        calls.append(x.shape[0])
        return p.shared_experts(x)

    kernel = _build(shared_experts=shared)
    state = _send(kernel, *_inputs(p))
    kernel.compute_shared(state)
    kernel.compute_shared(state)
    _run_steps(kernel, state)
    assert calls == [p.hidden.shape[0]]
    # Without shared experts the step is a no-op and the output is the routed output.
    plain = _build()
    state = _send(plain, *_inputs(p))
    plain.compute_shared(state)
    assert state.shared_output is None
    assert _run_steps(plain, state) is state.routed_output


def test_a_backend_whose_send_never_holds_the_host_sends_nothing_in_the_first_half():
    """`dispatch_prepare` runs the backend's part before its send; for every backend but
    DeepEP's normal kernels that is nothing: the whole `prepare_async` runs in `dispatch_send`."""
    p = make_problem(0, "random")
    kernel = _build()
    assert not kernel.prepare_finalize.yields_in_send
    sends = []
    prepare_async = kernel.prepare_finalize.prepare_async
    kernel.prepare_finalize.prepare_async = lambda *a, **k: sends.append(a[0].shape) or prepare_async(*a, **k)
    state = kernel.dispatch_prepare(*_inputs(p))
    assert sends == [] and state.dispatch_receiver is None
    kernel.dispatch_send(state)
    assert sends == [p.hidden.shape]
    torch.testing.assert_close(_run_steps(kernel, state), kernel(*_inputs(p)))


def test_a_skipped_or_repeated_step_is_a_clear_error():
    p = make_problem(0, "random")
    kernel = _build()
    state = kernel.dispatch_prepare(*_inputs(p))
    with pytest.raises(RuntimeError, match="dispatch_send first"):
        kernel.dispatch_recv(state)
    kernel.dispatch_send(state)
    with pytest.raises(RuntimeError, match="dispatch_prepare first.*sent once"):
        kernel.dispatch_send(state)
    with pytest.raises(RuntimeError, match="dispatch_recv first"):
        kernel.compute_experts(state)
    kernel.dispatch_recv(state)
    with pytest.raises(RuntimeError, match="received once"):
        kernel.dispatch_recv(state)
    with pytest.raises(RuntimeError, match="compute_experts first"):
        kernel.combine_send(state)
    with pytest.raises(RuntimeError, match="combine_send first"):
        kernel.combine_recv(state)
    with pytest.raises(RuntimeError, match="combine_recv first"):
        kernel.output(state)
    with pytest.raises(ValueError, match="hidden_states"):
        kernel.dispatch_prepare(p.hidden[0], *_inputs(p)[1:])


def _interleaved(rank, world, backends):
    """Two ubatches, B starting two steps after A (SGLang's decode delta), then
    taking turns: what the stage executor does, with no DBO context."""
    errors = {}
    for all2all in backends:
        p = make_problem(rank, "random", num_tokens=13)
        kernel = _build(all2all, shared_experts=p.shared_experts)
        expected = kernel(*_inputs(p, rank, world))
        halves = [slice(0, 7), slice(7, 13)]
        states = [None, None]
        steps = [
            lambda i: states.__setitem__(i, kernel.dispatch_prepare(*_inputs(p, rank, world, halves[i]))),
            lambda i: kernel.dispatch_send(states[i]),
            lambda i: kernel.compute_shared(states[i]),
            lambda i: kernel.dispatch_recv(states[i]),
            lambda i: kernel.compute_experts(states[i]),
            lambda i: kernel.combine_send(states[i]),
            lambda i: kernel.combine_recv(states[i]),
        ]
        order = sorted(((ub, s) for ub in (0, 1) for s in range(len(steps))), key=lambda us: (us[1] + 2 * us[0], us[0]))
        for ub, s in order:
            steps[s](ub)
        out = torch.cat([kernel.output(states[0]), kernel.output(states[1])])
        errors[all2all] = float((out - expected).abs().max())
    return errors


@pytest.mark.slow
def test_interleaved_ubatches_equal_forward_on_two_ranks():
    per_rank = run_distributed(_interleaved, 2, ["torch_a2a", "torch_a2a_ll"], timeout_s=120)
    assert all(err < 2e-5 for errors in per_rank for err in errors.values()), per_rank
