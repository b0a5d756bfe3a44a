"""`CpuGraph`: a CPU stand-in for `torch.cuda.CUDAGraph`, with the same contract.

Capture runs the callable once, for real, on its static input buffers while a
`TorchDispatchMode` records every ATen op that reaches the dispatcher: the op, and its
arguments with each tensor replaced by a reference. A tensor argument is either

- an *intermediate*: the output of an earlier recorded op, referenced by slot; or
- an *external* tensor: anything the capture did not create (static input buffers,
  parameters, KV caches, tensors made before the capture). It is held by reference and
  read (or written, for in-place ops) live at every replay, like the fixed addresses a
  CUDA graph bakes in. A tensor created from Python data inside the capture
  (`torch.tensor([...])`, i.e. `aten.lift_fresh`) is snapshotted as a constant instead.

`replay()` walks the op list with no Python of the captured callable, no ubatch worker and
no `dbo_*` call: it reads the current contents of the static inputs, re-issues every
recorded op (functional collectives included: `_c10d_functional.all_to_all_single`,
`wait_tensor`, `all_reduce`, ... are dispatcher ops, so they are in the list and run again
on the same process group, in the recorded order), drops each intermediate after its last
use and copies the results into the static output tensors, the very tensors `capture`
returned: replay writes into the same outputs every time.

Host syncs are refused at capture (the rules: `graph_refusals.py`) with a `GraphCaptureError`
naming the op, raised before the op runs (and raised again at the end of the capture if
model code swallowed it):

- `aten._local_scalar_dense`: `.item()`, `int()/float()/bool()` of a tensor, Python
  control flow on tensor values, and ops that validate on the host (on CPU,
  `F.one_hot` checks its class ids this way);
- `aten.is_nonzero`, `aten.equal` and any other op returning a host number or bool;
- data-dependent output shapes: `aten.nonzero`, `aten.argwhere`, `aten.masked_select`,
  the `unique` family, `aten.bincount`, sparse conversions, `repeat_interleave` with
  tensor repeats and no `output_size`, indexing with a boolean mask (`x[mask]`), and
  boolean-mask assignment of more than one value;
- `Tensor.tolist()`, `.numpy()`, `__array__`, `__dlpack__`, which read the data without
  going through the dispatcher (caught by a `TorchFunctionMode`);
- non-functional collectives (`c10d.*`, i.e. `dist.all_reduce(...)` and friends): their
  completion is a `Work.wait()` the dispatcher never sees; use
  `torch.distributed._functional_collectives`.

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

Limitations, as with CUDA graphs: Python values computed at capture (shapes, Python
scalars, metadata read from objects, the ubatch split) are frozen into the graph; random
ops draw fresh numbers at each replay from the live generator; ops run by threads that
did not join the capture are not recorded (start work only through the ubatch executors);
replay runs without autograd, in the inference mode the capture ran in.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.platform.graph import (
    Graph,
    GraphCaptureError,
    _capturing,
    _CaptureState,
    graph_capture_active,
    join_graph_capture,
)
from tandem.platform.graph_refusals import HOST_SYNC_METHODS, HOST_SYNC_OPS, LIFT_OPS, op_name, refusal


class _Slot:
    """Reference to a recorded intermediate."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


class _Nested:
    """A list/tuple argument holding intermediates."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: list):
        self.kind, self.items = kind, items


def _resolve(x: Any, values: list) -> Any:
    t = type(x)
    if t is _Slot:
        return values[x.index]
    if t is _Nested:
        return x.kind(_resolve(i, values) for i in x.items)
    return x


_NO_OUTPUT, _ONE_OUTPUT, _SEQ_OUTPUT, _TREE_OUTPUT = range(4)


class _Step:
    __slots__ = ("func", "args", "kwargs", "dynamic", "out_kind", "out_slots", "free", "thread")

    def __init__(self, func, args, kwargs, dynamic, out_kind, out_slots, thread):
        self.func, self.args, self.kwargs, self.dynamic = func, args, kwargs, dynamic
        self.out_kind, self.out_slots, self.thread = out_kind, out_slots, thread
        self.free: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"{self.func}({', '.join(map(repr, self.args))})"


class _RecordingMode(TorchDispatchMode):
    def __init__(self, recorder: "_Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.dispatch(func, args, kwargs or {})


class _HostReadGuard(TorchFunctionMode):
    def __init__(self, recorder: "_Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in HOST_SYNC_METHODS and not self.recorder.closed:
            self.recorder.refuse(f"Tensor.{name}", HOST_SYNC_METHODS[name])
        return func(*args, **(kwargs or {}))


class _Recorder(_CaptureState):
    """One capture's op list, shared by every thread that joins the capture."""

    kind = "cpu"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[_Step] = []
        self.slots: list[_Slot] = []
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
        self.slots.append(_Slot(index))
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
            if any(type(i) in (_Slot, _Nested) for i in items):
                return _Nested(type(x), items)
            return x
        return x

    def _record(self, func, args, kwargs, out, thread: int) -> None:
        index = len(self.steps)
        t_args = tuple(self._template(a, index) for a in args)
        t_kwargs = {k: self._template(v, index) for k, v in kwargs.items()}
        dynamic = any(type(a) in (_Slot, _Nested) for a in t_args) or any(
            type(v) in (_Slot, _Nested) for v in t_kwargs.values()
        )
        inputs = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def fresh(t) -> bool:
            return isinstance(t, torch.Tensor) and id(t) not in inputs

        if isinstance(out, torch.Tensor):
            kind, slots = (_ONE_OUTPUT, self._new_slot(out)) if fresh(out) else (_NO_OUTPUT, None)
        elif isinstance(out, (list, tuple)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
            slots = tuple((i, self._new_slot(o)) for i, o in enumerate(out) if fresh(o))
            kind = _SEQ_OUTPUT if slots else _NO_OUTPUT
        else:
            leaves = pytree.tree_leaves(out)
            slots = tuple((i, self._new_slot(o)) for i, o in enumerate(leaves) if fresh(o))
            kind = _TREE_OUTPUT if slots else _NO_OUTPUT
        self.steps.append(_Step(func, t_args, t_kwargs, dynamic, kind, slots, thread))

    def _record_lift(self, func, args, kwargs, thread: int):
        # `torch.tensor(data)` inside the capture: the data is a constant of the graph, and
        # each replay gets a fresh copy of it (the capture may mutate its own copy).
        snapshot = torch.ops.aten.clone.default(args[0])
        out = func(*args, **kwargs)
        with self.lock:
            self.keepalive.append(snapshot)
            slot = self._new_slot(out)
            self.steps.append(_Step(torch.ops.aten.clone.default, (snapshot,), {}, False, _ONE_OUTPUT, slot, thread))
        return out

    def close(self) -> None:
        self.closed = True


class CpuGraph(Graph):
    """Record a callable's ATen ops once; replay them on new contents of its inputs.

    ```
    g = CpuGraph()
    static_x = torch.zeros(8, 16)
    static_y = g.capture(model, static_x)     # runs model once, records it
    static_x.copy_(new_x); g.replay()         # static_y now holds model(new_x)
    ```
    """

    capture_computes_outputs = True

    def __init__(self) -> None:
        self._steps: list[_Step] | None = None
        self._num_slots = 0
        self._outputs: Any = None
        self._output_copies: list[tuple[torch.Tensor, int]] = []
        self._inference = False
        self.num_replays = 0

    @property
    def captured(self) -> bool:
        return self._steps is not None

    @property
    def outputs(self) -> Any:
        self._check_captured()
        return self._outputs

    @property
    def ops(self) -> list[str]:
        """The recorded ops in replay order, e.g. `"_c10d_functional.wait_tensor.default"`."""
        self._check_captured()
        return [str(step.func) for step in self._steps]

    @property
    def num_threads(self) -> int:
        """How many OS threads contributed ops to the capture."""
        self._check_captured()
        return len({step.thread for step in self._steps})

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._steps is not None:
            raise RuntimeError("this CpuGraph is already captured; call reset() to capture again")
        if graph_capture_active():
            raise RuntimeError("graph captures cannot be nested")
        recorder = _Recorder()
        try:
            with _capturing(recorder), recorder.join_thread():
                out = fn(*args, **kwargs)
                out = _settle_async_outputs(out)
        except BaseException as exc:
            recorder.close()
            if recorder.error is not None and recorder.error is not exc and not isinstance(exc, GraphCaptureError):
                raise recorder.error from exc
            raise
        recorder.close()
        if recorder.error is not None:
            raise recorder.error
        if not recorder.steps:
            raise GraphCaptureError(
                "the graph capture recorded no ops: a replay would do nothing and return stale outputs "
                "(did the captured callable run its tensor work outside the capture?)"
            )
        self._finalize(recorder, out)
        return out

    def _finalize(self, recorder: _Recorder, out: Any) -> None:
        outputs = []
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                slot = recorder.slot_of.get(id(leaf))
                if slot is not None:
                    outputs.append((leaf, slot))
        keep = {slot for _, slot in outputs}
        frees: dict[int, list[int]] = {}
        for slot, last in enumerate(recorder.last_use):
            if slot not in keep and last >= 0:
                frees.setdefault(last, []).append(slot)
        for index, slots in frees.items():
            recorder.steps[index].free = tuple(slots)
        self._steps = recorder.steps
        self._num_slots = len(recorder.slots)
        self._outputs = out
        self._output_copies = outputs
        self._inference = recorder.inference

    def replay(self) -> Any:
        self._check_captured()
        values: list = [None] * self._num_slots
        mode = torch.inference_mode() if self._inference else contextlib.nullcontext()
        with torch.no_grad(), mode:
            for step in self._steps:
                if step.dynamic:
                    args = tuple(_resolve(a, values) for a in step.args)
                    kwargs = {k: _resolve(v, values) for k, v in step.kwargs.items()}
                else:
                    args, kwargs = step.args, step.kwargs
                out = step.func(*args, **kwargs)
                kind = step.out_kind
                if kind == _ONE_OUTPUT:
                    values[step.out_slots] = out
                elif kind == _SEQ_OUTPUT:
                    for i, slot in step.out_slots:
                        values[slot] = out[i]
                elif kind == _TREE_OUTPUT:
                    leaves = pytree.tree_leaves(out)
                    for i, slot in step.out_slots:
                        values[slot] = leaves[i]
                for slot in step.free:
                    values[slot] = None
            for static, slot in self._output_copies:
                result = values[slot]
                if result is not static:
                    static.copy_(result)
        self.num_replays += 1
        return self._outputs

    def reset(self) -> None:
        self._steps = None
        self._num_slots = 0
        self._outputs = None
        self._output_copies = []

    def _check_captured(self) -> None:
        if self._steps is None:
            raise RuntimeError("this CpuGraph has not been captured (or its capture failed)")

    def __repr__(self) -> str:
        state = f"{len(self._steps)} ops" if self._steps is not None else "not captured"
        return f"CpuGraph({state})"


def _settle_async_outputs(out: Any) -> Any:
    """Wait (recorded) on functional-collective results returned unwaited."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except Exception:  # noqa: BLE001 - torch built without distributed
        return out
    return pytree.tree_map_only(AsyncCollectiveTensor, lambda t: t.trigger_wait(), out)


__all__ = [
    "CpuGraph",
    "GraphCaptureError",
    "HOST_SYNC_METHODS",
    "HOST_SYNC_OPS",
    "graph_capture_active",
    "join_graph_capture",
]
