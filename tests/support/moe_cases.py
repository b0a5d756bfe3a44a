"""Shared problem set-up for the modular-kernel tests: every rank builds the same global
problem from a seed and keeps its own token shard."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from tandem.contexts import dbo_current_ubatch_id, run_ubatches
from tandem.modular_kernels import select_experts, torch_moe_reference

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 128, 64


@dataclass
class Problem:
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w1: torch.Tensor  # all experts
    w2: torch.Tensor
    shared_w1: torch.Tensor
    shared_w2: torch.Tensor

    def local_weights(self, rank: int, world: int):
        n = self.w1.shape[0] // world
        return self.w1[rank * n : (rank + 1) * n], self.w2[rank * n : (rank + 1) * n]

    def shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        from tandem.modular_kernels import expert_mlp

        return expert_mlp(x, self.shared_w1, self.shared_w2)

    def reference(self, with_shared: bool = False) -> torch.Tensor:
        out = torch_moe_reference(self.hidden, self.w1, self.w2, self.topk_weights, self.topk_ids)
        return out + self.shared_experts(self.hidden) if with_shared else out


def make_problem(rank: int, routing: str, num_tokens: int = 12, seed: int = 0, hidden: int = HIDDEN,
                 intermediate: int = INTERMEDIATE, num_experts: int = NUM_EXPERTS) -> Problem:
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate**-0.5
    shared_w1 = torch.randn(2 * intermediate, hidden, generator=g) * hidden**-0.5
    shared_w2 = torch.randn(hidden, intermediate, generator=g) * intermediate**-0.5
    g_rank = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    if routing == "empty":
        num_tokens = 0
    x = torch.randn(num_tokens, hidden, generator=g_rank)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g_rank), TOP_K, renormalize=True)
    if routing == "one_expert":
        ids = torch.stack([torch.full((num_tokens,), num_experts - 1), torch.full((num_tokens,), -1)], dim=1)
    elif routing == "masked":
        ids[::3, 1] = -1
        ids[1::4, 0] = -1
    elif routing != "random" and routing != "empty":
        raise ValueError(routing)
    return Problem(x, weights, ids, w1, w2, shared_w1, shared_w2)


def run_kernel(kernel, problem: Problem, rank: int, world: int, *, num_ubatches: int = 1, executor: str = "thread"):
    w1, w2 = problem.local_weights(rank, world)
    if num_ubatches == 1:
        return kernel(problem.hidden, w1, w2, problem.topk_weights, problem.topk_ids)
    bounds = torch.linspace(0, problem.hidden.shape[0], num_ubatches + 1).long().tolist()

    def ubatch(lo, hi):
        return lambda: kernel(problem.hidden[lo:hi], w1, w2, problem.topk_weights[lo:hi], problem.topk_ids[lo:hi])

    return torch.cat(run_ubatches([ubatch(lo, hi) for lo, hi in zip(bounds, bounds[1:])], executor=executor))


class RecordingPrepareFinalize:
    """Wraps a PrepareAndFinalize and records sends and receives with the ubatch that ran them."""

    def __init__(self, inner, trace: list):
        self._inner = inner
        self._trace = trace

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _wrap(self, what, pair):
        hook, receiver = pair
        owner = dbo_current_ubatch_id()
        self._trace.append((f"send_{what}", owner))

        def recorded_hook():
            self._trace.append((f"recv_{what}", owner, "by", dbo_current_ubatch_id()))
            if hook is not None:
                hook()

        return recorded_hook, receiver

    def prepare_before_send(self, *args, **kwargs):
        send = self._inner.prepare_before_send(*args, **kwargs)
        return lambda: self._wrap("dispatch", send())

    def prepare_async(self, *args, **kwargs):
        return self._wrap("dispatch", self._inner.prepare_async(*args, **kwargs))

    def finalize_before_send(self, *args, **kwargs):
        send = self._inner.finalize_before_send(*args, **kwargs)
        return lambda: self._wrap("combine", send())

    def finalize_async(self, *args, **kwargs):
        return self._wrap("combine", self._inner.finalize_async(*args, **kwargs))


def failing_import(monkeypatch, tmp_path, module: str, assertion: str) -> None:
    """Make `import <module>` fail with `AssertionError(assertion)`, as DeepEP's and
    DeepGEMM's imports do when their environment checks fail."""
    package = tmp_path / module
    package.mkdir()
    (package / "__init__.py").write_text(f"assert False, {assertion!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


def assert_every_case_passed(per_rank: list[dict], num_cases: int) -> None:
    """Each rank's report maps a case name to True when it passed."""
    failed = [(rank, case) for rank, report in enumerate(per_rank) for case, ok in report.items() if ok is not True]
    assert failed == [], str(failed)
    assert all(len(report) == num_cases for report in per_rank), [len(report) for report in per_rank]


def dispatch_budget(all2all: str, tokens: int) -> dict:
    """The dispatch token budget as a build_moe_kernel keyword, for the backends that take one
    (the factory refuses it elsewhere)."""
    from tandem.modular_kernels.factory import DISPATCH_OPTIONS

    return {"dispatch_max_tokens_per_rank": tokens} if "dispatch_max_tokens_per_rank" in DISPATCH_OPTIONS[all2all] else {}
