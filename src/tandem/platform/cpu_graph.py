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

Multi-thread capture: a DBO step's ubatches run on worker threads (or greenlets), and every
thread that joins the capture records into one shared op list (`cpu_graph_recorder.py`).

Limitations, as with CUDA graphs: Python values computed at capture (shapes, Python
scalars, metadata read from objects, the ubatch split) are frozen into the graph; random
ops draw fresh numbers at each replay from the live generator; ops run by threads that
did not join the capture are not recorded (start work only through the ubatch executors);
replay runs without autograd, in the inference mode the capture ran in.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from tandem.platform.cpu_graph_recorder import ONE_OUTPUT, SEQ_OUTPUT, TREE_OUTPUT, Recorder, Step, resolve
from tandem.platform.graph import Graph, GraphCaptureError, _capturing, graph_capture_active, join_graph_capture
from tandem.platform.graph_refusals import HOST_SYNC_METHODS, HOST_SYNC_OPS


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
        self._steps: list[Step] | None = None
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
        recorder = Recorder()
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

    def _finalize(self, recorder: Recorder, out: Any) -> None:
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
                    args = tuple(resolve(a, values) for a in step.args)
                    kwargs = {k: resolve(v, values) for k, v in step.kwargs.items()}
                else:
                    args, kwargs = step.args, step.kwargs
                out = step.func(*args, **kwargs)
                kind = step.out_kind
                if kind == ONE_OUTPUT:
                    values[step.out_slots] = out
                elif kind == SEQ_OUTPUT:
                    for i, slot in step.out_slots:
                        values[slot] = out[i]
                elif kind == TREE_OUTPUT:
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
