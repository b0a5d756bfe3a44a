"""How a `CpuGraph` capture records: the op list with each tensor argument a reference
(`Slot` for an intermediate, the tensor itself for an external one), the host-sync refusals
(rules in `graph_refusals.py`), and the threads that join the capture.

Multi-thread capture. Dispatch and function modes are per OS thread, but a DBO step runs
its ubatches on worker threads (or greenlets on the caller's thread). The capture
therefore owns one shared recorder and publishes it in a `ContextVar`
(`tandem.platform.graph._ACTIVE_CAPTURE`). The ubatch executors copy the caller's context
into every ubatch and wrap it in `join_graph_capture()`, which, in a thread that is not yet
recording, pushes a fresh pair of modes bound to the same recorder (and mirrors the
capturing thread's grad / inference mode) for the duration of that ubatch; greenlets on
the capturing thread already run under its modes and push nothing. Because ubatches run
strictly one at a time, appending to one list records the ops of all threads in execution
order, which is also the order their collectives were issued in; a replay issues them in
that order on every rank. The recorder checks the one-at-a-time rule: an op starting on
one thread while another thread's op is still running fails the capture.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.platform.graph import GraphCaptureError, _CaptureState
from tandem.platform.graph_refusals import HOST_SYNC_METHODS, LIFT_OPS, op_name, refusal


class Slot:
    """Reference to a recorded intermediate."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


class Nested:
    """A list/tuple argument holding intermediates."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: list):
        self.kind, self.items = kind, items


def resolve(x: Any, values: list) -> Any:
    """A recorded argument with its references replaced by the replay's `values`."""
    t = type(x)
    if t is Slot:
        return values[x.index]
    if t is Nested:
        return x.kind(resolve(i, values) for i in x.items)
    return x


NO_OUTPUT, ONE_OUTPUT, SEQ_OUTPUT, TREE_OUTPUT = range(4)


class Step:
    """One recorded op: its arguments (references where intermediates go), where its outputs
    go (`out_kind`, `out_slots`), and the slots a replay frees after it."""

    __slots__ = ("func", "args", "kwargs", "dynamic", "out_kind", "out_slots", "free", "thread")

    def __init__(self, func, args, kwargs, dynamic, out_kind, out_slots, thread):
        self.func, self.args, self.kwargs, self.dynamic = func, args, kwargs, dynamic
        self.out_kind, self.out_slots, self.thread = out_kind, out_slots, thread
        self.free: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"{self.func}({', '.join(map(repr, self.args))})"


class _RecordingMode(TorchDispatchMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.dispatch(func, args, kwargs or {})


class _HostReadGuard(TorchFunctionMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in HOST_SYNC_METHODS and not self.recorder.closed:
            self.recorder.refuse(f"Tensor.{name}", HOST_SYNC_METHODS[name])
        return func(*args, **(kwargs or {}))


class Recorder(_CaptureState):
    """One capture's op list, shared by every thread that joins the capture."""

    kind = "cpu"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[Step] = []
        self.slots: list[Slot] = []
        self.slot_of: dict[int, int] = {}
        self.last_use: list[int] = []
        # Every tensor seen stays alive until the capture ends, so no id() is reused.
        self.keepalive: list[torch.Tensor] = []
        self.threads: set[int] = set()
        self.error: GraphCaptureError | None = None
        self.closed = False
        self.running_on: int | None = None
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()

    # -- joining threads -----------------------------------------------------------------

    @contextlib.contextmanager
    def join_thread(self) -> Iterator[None]:
        me = threading.get_ident()
        if me in self.threads or self.closed:
            yield
            return
        self.threads.add(me)
        try:
            with contextlib.ExitStack() as stack:
                if self.inference and not torch.is_inference_mode_enabled():
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
                stack.enter_context(_HostReadGuard(self))
                stack.enter_context(_RecordingMode(self))
                yield
        finally:
            self.threads.discard(me)

    # -- recording -----------------------------------------------------------------------

    def refuse(self, name: str, reason: str) -> None:
        error = GraphCaptureError(
            f"graph capture cannot record {name}: {reason}. A captured forward must not sync with "
            f"the host; only code whose work and shapes are fixed for the captured sizes can be "
            f"captured (see tandem.platform.cpu_graph).",
            op=name,
        )
        with self.lock:
            if self.error is None:
                self.error = error
        raise error

    def dispatch(self, func, args: tuple, kwargs: dict):
        if self.closed:
            return func(*args, **kwargs)
        name = op_name(func)
        if self.error is not None:
            # Model code swallowed the first refusal; keep failing loudly.
            raise self.error
        reason = refusal(func, name, args, kwargs)
        if reason is not None:
            self.refuse(name, reason)
        me = threading.get_ident()
        with self.lock:
            if self.running_on is not None and self.running_on != me:
                self.error = GraphCaptureError(
                    f"graph capture saw {name} start on one thread while another thread's op was still "
                    "running; ubatches must run strictly one at a time to be recorded in order",
                    op=name,
                )
                raise self.error
            self.running_on = me
        try:
            if name.split(".", 1)[1] in LIFT_OPS and func.namespace == "aten":
                return self._record_lift(func, args, kwargs, me)
            out = func(*args, **kwargs)
            with self.lock:
                self._record(func, args, kwargs, out, me)
            return out
        finally:
            self.running_on = None

    def _new_slot(self, tensor: torch.Tensor) -> int:
        index = len(self.slots)
        self.slots.append(Slot(index))
        self.last_use.append(-1)
        self.slot_of[id(tensor)] = index
        self.keepalive.append(tensor)
        return index

    def _template(self, x: Any, step_index: int) -> Any:
        if isinstance(x, torch.Tensor):
            slot = self.slot_of.get(id(x))
            if slot is None:
                self.keepalive.append(x)  # external: referenced live at replay
                return x
            self.last_use[slot] = step_index
            return self.slots[slot]
        if type(x) in (list, tuple):
            items = [self._template(i, step_index) for i in x]
            if any(type(i) in (Slot, Nested) for i in items):
                return Nested(type(x), items)
            return x
        return x

    def _record(self, func, args, kwargs, out, thread: int) -> None:
        index = len(self.steps)
        t_args = tuple(self._template(a, index) for a in args)
        t_kwargs = {k: self._template(v, index) for k, v in kwargs.items()}
        dynamic = any(type(a) in (Slot, Nested) for a in t_args) or any(
            type(v) in (Slot, Nested) for v in t_kwargs.values()
        )
        inputs = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def fresh(t) -> bool:
            return isinstance(t, torch.Tensor) and id(t) not in inputs

        if isinstance(out, torch.Tensor):
            kind, slots = (ONE_OUTPUT, self._new_slot(out)) if fresh(out) else (NO_OUTPUT, None)
        elif isinstance(out, (list, tuple)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
            slots = tuple((i, self._new_slot(o)) for i, o in enumerate(out) if fresh(o))
            kind = SEQ_OUTPUT if slots else NO_OUTPUT
        else:
            leaves = pytree.tree_leaves(out)
            slots = tuple((i, self._new_slot(o)) for i, o in enumerate(leaves) if fresh(o))
            kind = TREE_OUTPUT if slots else NO_OUTPUT
        self.steps.append(Step(func, t_args, t_kwargs, dynamic, kind, slots, thread))

    def _record_lift(self, func, args, kwargs, thread: int):
        # `torch.tensor(data)` inside the capture: the data is a constant of the graph, and
        # each replay gets a fresh copy of it (the capture may mutate its own copy).
        snapshot = torch.ops.aten.clone.default(args[0])
        out = func(*args, **kwargs)
        with self.lock:
            self.keepalive.append(snapshot)
            slot = self._new_slot(out)
            self.steps.append(Step(torch.ops.aten.clone.default, (snapshot,), {}, False, ONE_OUTPUT, slot, thread))
        return out

    def close(self) -> None:
        self.closed = True
