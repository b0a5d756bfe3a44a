"""The work of the MoE stack besides its GEMMs, counted from the code a step runs, and this
host's measured rate for it (`--hardware here`, #31).

Count: one layer of `tandem bench --model moe-stack` (`bench.moe_stack._StackLayer`, the
stack's own operations, with the compute-only step's local kernel and local expert ids) runs
under a dispatch mode at a ubatch's token count, one operation of the simulator's op list at a
time. Every ATen op is recorded under the operation that issued it: its count and the bytes of
the tensors it reads and writes (float32 activations, int64 indices, as the step holds them;
an in-place op's tensor once; an allocation's only what it writes); views move nothing and
count nothing. The GEMMs (`mm`, `addmm`, `_grouped_mm`), which the
simulator prices on its GEMM curve, are not run: they return zeros of their shape, so a count
at 512 tokens takes milliseconds. Routing (`select_experts`) is timed as one call instead (see
below). The transfers' own work (the dispatch's gathers, the combine's `index_add`) is not
counted here: the gloo line of `simulate.host_link` times it with the transfer.

Rate (measured in the same run, `measure_elementwise`): lines through (bytes, seconds) of an
allocating float32 `torch.add` (the plain ops: adds, multiplies, fills, copies, gathers) and
`torch.tanh` (the transcendental ones: tanh, silu, sigmoid, exp, softmax) over [rows, 1024]
buffers of a decode ubatch's to a prefill step's size, and a line through (tokens, seconds) of
the runtime's `select_experts` on the stack's [tokens, 8] router logits: each an intercept (fixed
per call) and a slope. The sizes take turns within each repeat (a passing load touches them
alike), median of the repeats.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tandem.bench.moe_stack import STACK_SHAPE
from tandem.simulate.line_fit import UNRESOLVED, fit_rates, unresolved

#: Rows of the measured buffers and tokens of the measured routing: a decode ubatch to a prefill step.
ROWS = (16, 128, 512)
#: Op kinds the simulator prices, each on its own measured line.
KINDS = ("plain", "transcendental", "routing")
#: Distinct 1024 x 1024 float32 weights the measuring GEMMs take turns over (64 MiB, far more
#: than a core's cache), so each timed op reads a GEMM's fresh output as a step's op does.
POOL_WEIGHTS = 16
#: ATen ops (by name, without the overload) priced at `torch.tanh`'s line.
TRANSCENDENTAL = frozenset({"tanh", "silu", "sigmoid", "exp", "_softmax", "softmax", "gelu", "log_softmax", "_log_softmax"})
#: The GEMMs: priced by the simulator's GEMM curve, not run while counting.
GEMMS = frozenset({"mm", "addmm", "_grouped_mm"})
#: The routing call, timed whole (its own line), and the ops under it not counted again.
ROUTING_OP = "select_experts"


@dataclass(frozen=True)
class Work:
    """One operation's non-GEMM work on one ubatch, per kind: its ops and their units (bytes
    read and written; for `routing`, calls and tokens)."""

    ops: dict[str, int]
    units: dict[str, float]


@dataclass(frozen=True)
class ElementwiseFit:
    """Per kind: seconds fixed per op and units (bytes; tokens for routing) per second after
    that; `points` are the measured (units, seconds) pairs the line goes through."""

    fixed_s: dict[str, float]
    per_s: dict[str, float]
    points: dict[str, list[tuple[float, float]]]
    measured_by: str = "one process"

    @classmethod
    def from_points(cls, points: dict[str, list[tuple[float, float]]], measured_by: str = "one process") -> ElementwiseFit:
        return cls(*fit_rates(points), points, measured_by)

    @classmethod
    def unmeasured(cls) -> ElementwiseFit:
        """No figure: the profile keeps the simulator's norm passes at the sum's bandwidth."""
        return cls({}, {}, {})

    def describe(self, kind: str) -> str:
        unit = "tokens" if kind == "routing" else "MB"
        scale = 1.0 if kind == "routing" else 1e-6
        pts = ", ".join(f"{x * scale:.3g} {unit} {s * 1e6:.0f} us" for x, s in self.points.get(kind, ()))
        return f"{kind}: {pts} ({UNRESOLVED})" if kind in unresolved(self.points) else f"{kind}: {pts}"

    def time(self, work: Work) -> float:
        """Seconds of `work`: per kind, its ops at the fixed cost and its units at the rate."""
        return sum(work.ops.get(k, 0) * self.fixed_s[k] + work.units.get(k, 0.0) / self.per_s[k] for k in self.fixed_s)

    def figures(self) -> dict[str, tuple]:
        """The profile's figures (`host.host_profile`), each with how it was measured; none unmeasured."""
        if not self.points:
            return {}
        how = {
            "plain": "an allocating float32 torch.add of two [rows, 1024] buffers (units: bytes read and written)",
            "transcendental": "an allocating float32 torch.tanh of a [rows, 1024] buffer (units: bytes read and written)",
            "routing": "the runtime's select_experts (softmax top-2 of 8, renormalized) on [tokens, 8] router logits (units: tokens)",
        }
        lead = (f"measured in this run (simulate.host_elementwise) by {self.measured_by}, one thread, each op on the "
                "fresh output of a GEMM over a weight not in cache, median of the repeats, a least-squares line through "
                "(units, seconds) of ")
        source = {k: f"{lead}{how[k]}: {self.describe(k)}" for k in self.points}
        return {
            "elementwise_op_s": (dict(self.fixed_s), "per kind, the line's intercept, fixed per op: " + "; ".join(source.values())),
            "elementwise_units_per_s": (dict(self.per_s), "per kind, the line's slope, units per second: " + "; ".join(source.values())),
        }

    @classmethod
    def from_figures(cls, figures: dict) -> ElementwiseFit | None:
        """The fit a profile carries (`elementwise_op_s`, `elementwise_units_per_s`), None without it (the GPUs)."""
        if "elementwise_op_s" not in figures:
            return None
        return cls(dict(figures["elementwise_op_s"]), dict(figures["elementwise_units_per_s"]), {})


def measure_elementwise(rows: tuple[int, ...] = ROWS, repeat: int = 7, warmup: int = 2) -> ElementwiseFit:
    """The three lines of the module docstring, on this thread with one intra-op thread (as a
    rank; the caller's thread count is set back after). Each timed op reads what a step's op
    reads: the fresh output of a GEMM over a weight not in cache (`POOL_WEIGHTS` distinct weights
    taking turns), and allocates its output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ElementwiseFit.from_points(_measured_points(rows, repeat, warmup))
    finally:
        torch.set_num_threads(threads)


def _measured_points(rows: tuple[int, ...], repeat: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """(units, median seconds) per kind and size, timed as `measure_elementwise` says."""
    from tandem.modular_kernels import select_experts

    hidden, experts, top_k = STACK_SHAPE["hidden"], STACK_SHAPE["experts"], STACK_SHAPE["top_k"]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.full((hidden, hidden), hidden**-0.5) for _ in range(POOL_WEIGHTS)]
    router = torch.randn(hidden, experts, generator=gen) * hidden**-0.5
    xs = [torch.randn(r, hidden, generator=gen) for r in rows]
    residuals = [torch.randn(r, hidden, generator=gen) for r in rows]
    # kind: (input from the GEMM's output, the op, its units: bytes read and written, or tokens)
    calls = {
        "plain": (lambda h: h, lambda h, i: torch.add(h, residuals[i]), lambda r: 3.0 * r * hidden * 4),
        "transcendental": (lambda h: h, lambda h, i: torch.tanh(h), lambda r: 2.0 * r * hidden * 4),
        "routing": (lambda h: torch.mm(h, router), lambda x, i: select_experts(x, top_k, renormalize=True), float),
    }
    times: dict[tuple[str, int], list[float]] = {(k, i): [] for k in calls for i in range(len(rows))}
    turn = 0
    for n in range(warmup + repeat):
        for kind, (prepare, call, _) in calls.items():
            for i, x in enumerate(xs):
                turn += 1
                h = prepare(torch.mm(x, weights[turn % POOL_WEIGHTS]))
                start = time.perf_counter()
                call(h, i)
                if n >= warmup:
                    times[kind, i].append(time.perf_counter() - start)
    return {kind: [(units(r), statistics.median(times[kind, i])) for i, r in enumerate(rows)] for kind, (_, _, units) in calls.items()}


class _Counter(TorchDispatchMode):
    """Records each ATen op's count and bytes under the current operation; skips the GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.current = ""
        self.ops: dict[str, dict[str, int]] = {}
        self.bytes: dict[str, dict[str, float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in GEMMS:
            a, b = args[1:3] if name == "addmm" else args[:2]
            return torch.zeros(a.shape[0], b.shape[-1])  # mm: [m, k] x [k, n]; grouped: [m, k] x [g, k, n]
        out = func(*args, **kwargs)
        if func.is_view or self.current == ROUTING_OP:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen]
        if name.startswith("new_") or name.endswith("_like"):
            inputs = []  # the tensor argument only gives the dtype and device
        moved = 0.0 if "empty" in name else float(sum(t.nbytes for t in inputs + outputs))
        kind = "transcendental" if name in TRANSCENDENTAL else "plain"
        per_op = self.ops.setdefault(self.current, {})
        per_op[kind] = per_op.get(kind, 0) + 1
        per_bytes = self.bytes.setdefault(self.current, {})
        per_bytes[kind] = per_bytes.get(kind, 0.0) + moved
        return out


@functools.lru_cache(maxsize=64)
def stack_layer_work(tokens: int, ep: int) -> dict[str, Work]:
    """Per operation of one MoE-stack layer on `tokens` tokens of one of `ep` ranks: its
    non-GEMM work, counted from the stack's own operations (see the module docstring)."""
    from tandem.bench.moe_stack import _StackLayer
    from tandem.contexts import YieldOperation
    from tandem.modular_kernels import build_moe_kernel, expert_mlp

    H, I, E, K = STACK_SHAPE["hidden"], STACK_SHAPE["intermediate"], STACK_SHAPE["experts"], STACK_SHAPE["top_k"]
    local = max(1, E // ep)
    weights = dict(wa=torch.zeros(H, H), wb=torch.zeros(H, H), router=torch.zeros(H, E), w1=torch.zeros(local, 2 * I, H),
                   w2=torch.zeros(local, H, I), sw1=torch.zeros(2 * I, H), sw2=torch.zeros(H, I))
    kernel = build_moe_kernel("local", "torch", num_experts=local, top_k=K, hidden_size=H,
                              shared_experts=lambda h: expert_mlp(h, weights["sw1"], weights["sw2"]))
    layer = _StackLayer(weights, kernel, K)
    routed = layer.select

    def local_ids(logits: torch.Tensor):  # the compute-only step's local expert ids
        weights_k, ids = routed(logits)
        return weights_k, ids % local

    layer.select = local_ids
    counter = _Counter()
    inputs: dict = {"hidden_states": torch.zeros(tokens, H), "residual": torch.zeros(tokens, H), "positions": None}
    state: dict = {}
    with counter:
        for op in layer.operations_strategy(decode=False).operations:
            if isinstance(op, YieldOperation):
                continue
            counter.current = op.__name__.removeprefix("op_")
            inputs = op(state, **(inputs or {}))
    work = {name: Work(counter.ops[name], counter.bytes[name]) for name in counter.ops}
    work[ROUTING_OP] = Work({"routing": 1}, {"routing": float(tokens)})
    return work


def traced_op_time(fit: ElementwiseFit, name: str, tokens: int, ep: int) -> float:
    """Seconds of the non-GEMM work of operation `name` of one MoE-stack layer on `tokens`
    tokens of one of `ep` ranks, on the measured `fit`."""
    work = stack_layer_work(tokens, ep).get(name)
    return fit.time(work) if work is not None and tokens else 0.0


__all__ = ["KINDS", "ROWS", "ElementwiseFit", "Work", "measure_elementwise", "stack_layer_work", "traced_op_time"]
