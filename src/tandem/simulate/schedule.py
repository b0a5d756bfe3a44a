"""Schedules, taken from the runtime's own code, and the two-stream time of one.

- The operation lists are the runtime's: stand-in layers that subclass
  `DecoderLayerOperations` answer `operations_strategy(decode)` (TBO's stages and
  `delta_stages`) and a stand-in model that subclasses `OperationsModel` says which leading
  layers run outside the overlap. The MoE part of DBO and of none is the order
  `FusedMoEModularKernel.forward` takes its steps in (traced from the real method), with a
  stage boundary where the real `_hand_over` yields, and the shared experts where
  `shared_experts_placement` puts them (the real methods, asked inside a ubatch, so
  `dbo_enabled()` answers as under DBO). A backend that `yields_in_send` (DeepEP's normal
  kernels) hands the host to the other ubatch inside its send, before it issues the transfer;
  TBO's lists issue that send after the stage's yield (`tbo_program(yields_in_send=...)`).
- The interleave is the runtime's `StageExecutor`: each ubatch's operations are run by it
  with recorders in place of the tensor work, and the order they run in is the order the
  host issues them.
- `play` times that issue order on two in-order streams: compute (every compute op, in
  issue order) and comm (every send, in issue order); a send starts after its ubatch's last
  compute, a receive holds its ubatch until the transfer lands. With `sync_comm` every send
  also blocks the compute stream until it lands (the runtime with no overlap). Each hand-over
  from one ubatch to another in the issue order costs the host `switch_s`, which delays the
  next compute op (a profile's `ubatch_switch_s`). A send with a `kernel` time runs that
  kernel on the compute stream first (a low-latency call's SM part), then its transfer. A send
  with a `host_wait` (not None) holds the host: no op issued after it starts before the
  transfer has started and run that long (DeepEP's normal dispatch: the CPU busy-waits for the
  received counts its notify kernel writes, before it can allocate the receive buffers and launch
  the dispatch; gloo's dispatch: its counts exchange is a synchronous all-to-all queued behind
  the bytes already on the link, 0 after the transfer starts).
- An op's `cost` is its time alone. With `overlap_rate`, its work progresses at that rate
  (<= 1) while the other stream runs something and at 1 otherwise: a compute op at the SMs a
  normal DeepEP transfer leaves it only while a transfer is in flight, a transfer at the
  bandwidth it keeps under overlap only while compute runs. Exact, not only against the
  transfers issued before a compute op: `play` first writes each op's start as the ends it
  waits for (issue order), then runs both streams in time, so a transfer issued after a
  compute op that starts during it (DBO's and TBO's next ubatch) slows it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

from tandem.contexts.operations import ExecutionOperation, StageExecutor, YieldOperation
from tandem.models.layer_operations import DecoderLayerOperations, OperationsModel
from tandem.simulate.kernel_trace import KERNEL_STEPS, moe_forward_order
from tandem.simulate.model_shape import ModelShape
from tandem.simulate.ops import RECEIVES, SENDS

#: Operations the simulator does not price on their own: the dispatch's half before its send
#: (casts and an event record; the send's cost holds the transfer's work).
_UNPRICED = {"dispatch_prepare"}
#: The MoE kernel's steps as the layers' operation lists name them.
_MOE_OPS = set(KERNEL_STEPS.values())


@dataclass(frozen=True)
class Step:
    layer: int  # -1: outside the decoder layers (the head)
    name: str


YIELD = Step(-2, "yield")


class _Layer(DecoderLayerOperations):
    """A decoder layer with only what `operations_strategy` reads: whether the backend's
    dispatch holds the host in its send (`yields_in_send`) places that send."""

    def __init__(self, index: int, sparse: bool, shared: bool, yields_in_send: bool = False):
        self.index = index
        kernel = None
        if sparse:
            backend = SimpleNamespace(yields_in_send=yields_in_send)
            kernel = SimpleNamespace(shared_experts=object() if shared else None, prepare_finalize=backend)
        self.feed_forward = SimpleNamespace(kernel=kernel)


class _Model(OperationsModel):
    def __init__(self, layers: list[_Layer]):
        self.model = SimpleNamespace(layers=layers)


def stand_in_layers(shape: ModelShape, yields_in_send: bool = False) -> list[_Layer]:
    shared = shape.shared_intermediate > 0
    return [_Layer(i, sparse, shared, yields_in_send) for i, sparse in enumerate(shape.sparse_layers)]


def _steps(operations: Sequence) -> list[Step]:
    out = []
    for op in operations:
        if isinstance(op, YieldOperation):
            out.append(YIELD)
        elif (name := op.__name__.removeprefix("op_")) not in _UNPRICED:
            out.append(Step(op.__self__.index, name))
    return out


def tbo_program(shape: ModelShape, decode: bool, *, yields_in_send: bool = False) -> tuple[list[Step], list[Step], int]:
    """(leading layers run on the whole batch, the overlapped steps, delta_stages), as the
    runtime's `OperationsModel` cuts them for a backend whose dispatch holds the host in its
    send (`PrepareAndFinalize.yields_in_send`: prefill issues that send after the yield) or not."""
    model = _Model(stand_in_layers(shape, yields_in_send))
    first = model._first_overlapped_layer()
    prefix = [s for layer in model.model.layers[:first] for s in _steps(layer.operations_strategy(decode=False).operations)]
    strategy = model.operations_strategy(decode)
    return [s for s in prefix if s is not YIELD], _steps(strategy.operations), strategy.delta_stages


def layer_steps(
    shape: ModelShape, *, dbo: bool, sbo_mode: str | None = None, yields_in_send: bool = False, blocks: int = 1
) -> list[Step]:
    """Every layer's operations (the runtime's prefill list, which has no stage cut outside
    the MoE), with its MoE part in the kernel's `forward` order (`moe_forward_order`; `blocks`:
    combine-down-gemm's)."""
    shared = shape.shared_intermediate > 0
    moe = moe_forward_order(shared, dbo=dbo, sbo_mode=sbo_mode, yields_in_send=yields_in_send, blocks=blocks)
    out: list[Step] = []
    for layer in stand_in_layers(shape):
        inserted = False
        for step in _steps(layer.operations_strategy(decode=False).operations):
            if step is YIELD:
                continue
            if step.name in _MOE_OPS:
                if not inserted:
                    out += [YIELD if n == "yield" else Step(layer.index, n) for n in moe]
                    inserted = True
                continue
            out.append(step)
    return out


def issue_order(programs: Sequence[Sequence[Step]], delta_stages: Sequence[int]) -> list[tuple[int, Step]]:
    """The order the runtime's `StageExecutor` runs the ubatches' steps in."""
    if len(programs) == 1:
        return [(0, s) for s in programs[0] if s is not YIELD]
    log: list[tuple[int, Step]] = []

    def op(u: int, step: Step):
        return ExecutionOperation(f"{step.name}@{step.layer}", lambda state, **_: log.append((u, step)) or {})

    ops = [[YieldOperation() if s is YIELD else op(u, s) for s in _trim(p)] for u, p in enumerate(programs)]
    StageExecutor().run([{} for _ in programs], ops, list(delta_stages))
    return log


def _trim(program: Sequence[Step]) -> list[Step]:
    """No empty stage: drop leading yields and collapse repeated ones."""
    out: list[Step] = []
    for s in program:
        if s is YIELD and (not out or out[-1] is YIELD):
            continue
        out.append(s)
    return out


@dataclass(frozen=True)
class Span:
    ubatch: int
    lane: str  # "compute" or "comm"
    step: Step
    start: float
    end: float


class _PendingStart:
    """The start of an op whose predecessors have not run yet: max(`base`, end of op i + delay
    for each i in `after`), known once those ops have ended (`value`)."""

    __slots__ = ("base", "after")

    def __init__(self, base: float = 0.0, after: dict[int, float] | None = None):
        self.base, self.after = base, after or {}

    def __add__(self, delay: float) -> "_PendingStart":
        return _PendingStart(self.base + delay, {i: d + delay for i, d in self.after.items()})

    def join(self, other: "_PendingStart") -> "_PendingStart":
        after = dict(self.after)
        for i, d in other.after.items():
            after[i] = max(after.get(i, d), d)
        return _PendingStart(max(self.base, other.base), after)

    def value(self, ends: dict[int, float]) -> float | None:
        if any(i not in ends for i in self.after):
            return None
        return max([self.base] + [ends[i] + d for i, d in self.after.items()])


@dataclass(frozen=True)
class _Op:
    ubatch: int
    lane: str
    step: Step
    start: _PendingStart
    work: float  # seconds alone
    rate: float  # progress while the other lane runs an op


def _issue(order, cost, sync_comm, switch_s, kernel, overlap_rate, host_wait) -> list[_Op]:
    """Each op of the issue order with its start as the ends of the ops it waits for."""
    zero, ops = _PendingStart(0.0), []
    compute_free = comm_free = zero
    host = zero  # the host issues nothing before this (it waits inside a send until then)
    ready: dict[int, _PendingStart] = {}
    landing: dict[tuple[int, str], _PendingStart] = {}
    rate = overlap_rate or (lambda u, step: 1.0)

    def add(u: int, lane: str, step: Step, start: _PendingStart, work: float, at_rate: float = 1.0) -> _PendingStart:
        if not work >= 0.0:  # also refuses NaN
            raise ValueError(f"play: {step.name} of layer {step.layer} (ubatch {u}, {lane} stream) costs {work!r} s; "
                             "an op's time cannot be negative")
        ops.append(_Op(u, lane, step, start.join(host), work, at_rate))
        return _PendingStart(float("-inf"), {len(ops) - 1: 0.0})

    issuing = order[0][0] if order else 0
    for u, step in order:
        if u != issuing:
            compute_free, issuing = compute_free + switch_s, u
        at = ready.get(u, zero)
        if step.name in SENDS:
            sm_time = kernel(u, step) if kernel else 0.0
            if sm_time:
                at = compute_free = ready[u] = add(u, "compute", step, compute_free.join(at), sm_time)
            start = comm_free.join(at).join(host)
            end = add(u, "comm", step, start, cost(u, step), rate(u, step))
            comm_free = landing[(u, SENDS[step.name])] = end
            if (waited := host_wait(u, step) if host_wait else None) is not None:
                host = start + waited
            if sync_comm:
                compute_free, ready[u] = compute_free.join(end), end
        elif step.name in RECEIVES:
            ready[u] = at.join(landing.pop((u, RECEIVES[step.name]), at))
        else:
            compute_free = ready[u] = add(u, "compute", step, compute_free.join(at), cost(u, step), rate(u, step))
    return ops


def _run(ops: list[_Op]) -> list[Span]:
    """Both lanes in time, each running its ops in order: an op's work progresses at its rate
    while the other lane runs an op, at 1 otherwise."""
    queues = {lane: [i for i, op in enumerate(ops) if op.lane == lane] for lane in ("compute", "comm")}
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    running: dict[str, list] = {}  # lane -> [op, start, end at the current rate, current rate]
    t = 0.0
    while True:
        for lane, queue in queues.items():
            if lane not in running and queue and (start := ops[queue[0]].start.value(ends)) is not None:
                running[lane] = [queue[0], start, start + ops[queue[0]].work, 1.0]
        if not running:
            break
        busy = {lane for lane, job in running.items() if job[1] <= t}
        for lane in busy:
            job = running[lane]
            rate = ops[job[0]].rate if len(busy) == 2 else 1.0
            if rate != job[3]:
                job[2], job[3] = t + (job[2] - t) * job[3] / rate, rate
        t = min(job[1] if job[1] > t else job[2] for job in running.values())
        for lane, job in list(running.items()):
            if job[1] <= t and job[2] <= t:
                starts[job[0]], ends[job[0]] = job[1], job[2]
                del running[lane]
                queues[lane].pop(0)
    if len(ends) != len(ops):
        raise RuntimeError("play: an op waits for one that never runs")
    return [Span(op.ubatch, op.lane, op.step, starts[i], ends[i]) for i, op in enumerate(ops)]


def play(
    order: Sequence[tuple[int, Step]], cost: Callable[[int, Step], float], *, sync_comm: bool, switch_s: float = 0.0,
    kernel: Callable[[int, Step], float] | None = None, overlap_rate: Callable[[int, Step], float] | None = None,
    host_wait: Callable[[int, Step], float | None] | None = None,
) -> list[Span]:
    """Time an issue order on one compute and one comm stream (see the module docstring):
    `cost` is each op's time alone, `overlap_rate` its progress while the other stream runs,
    `host_wait` how long after a send's transfer starts the host can issue again (None: the
    send does not hold the host)."""
    return _run(_issue(order, cost, sync_comm, switch_s, kernel, overlap_rate, host_wait))


__all__ = ["Span", "Step", "YIELD", "issue_order", "layer_steps", "moe_forward_order", "play", "tbo_program"]
