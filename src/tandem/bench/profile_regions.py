"""The regions `tandem profile` times in one engine step, and the hooks that time them.

A region is a module of the model (forward pre/post hooks) or a method of one object (the
scheduler's `schedule`, the runner's `step_inputs`, ...), wrapped on that instance only and
restored afterwards. Regions of the model are timed with device events (CUDA events on the
current stream of the thread that runs them; on the CPU the wall clock, the CPU's ops being
synchronous); host regions with the wall clock. Each row sums its region over every call of
the step (all decoder layers). While an `OpCounter` is attached every region is also one of
its scopes, so the row carries the kernels launched inside it.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from tandem.bench.op_count import OpCounter
from tandem.bench.step_cost import StepShape, is_moe_block, tensor_bytes
from tandem.platform import graph_capture_active

LAYER_INDEX = re.compile(r"^model\.layers\.\d+\.?")

#: Submodules of a decoder layer timed as rows: name under the layer -> (label, parent key).
LAYER_PARTS = {
    "": ("decoder layers", "forward"),
    "input_layernorm": ("norm (input)", "layers.*"),
    "self_attn": ("attention", "layers.*"),
    "post_attention_layernorm": ("norm (post-attention)", "layers.*"),
    "mlp": ("feed-forward", "layers.*"),
    "mlp.shared_experts": ("shared experts", "layers.*.mlp"),
    "mlp.shared_expert": ("shared experts", "layers.*.mlp"),
}


def _as_mlp(part: str, mlp_name: str) -> str:
    """`part` (a module path under a decoder layer) with the layer's feed-forward attribute
    spelled `mlp`."""
    if mlp_name != "mlp" and (part == mlp_name or part.startswith(mlp_name + ".")):
        return "mlp" + part[len(mlp_name):]
    return part


@dataclass
class Region:
    key: str
    label: str
    parent: str | None
    #: "device": device events on a GPU; "host": the wall clock everywhere.
    clock: str
    #: What the row's bytes and FLOPs come from: "module" (its modules' shapes), "experts",
    #: "gate" (the router's linear), "router" (activations only), "logits", "children" (the
    #: sum of its rows), "host" (none).
    cost: str
    modules: list = field(default_factory=list)


@dataclass
class StepRecord:
    """One step's measurements, filled by the hooks."""

    spans: dict = field(default_factory=lambda: defaultdict(list))
    calls: Counter = field(default_factory=Counter)
    activation_bytes: Counter = field(default_factory=Counter)
    forward_tokens: int = 0
    forward_calls: int = 0
    sampled_rows: int = 0
    shape: StepShape = StepShape((), ())
    #: id(MoE block) -> the top-k ids its router produced (device tensors, read after the step).
    topk_ids: dict = field(default_factory=lambda: defaultdict(list))

    def seconds(self, on_gpu: bool) -> dict[str, float]:
        """Per region, its time summed over calls (after the step: reads the events)."""
        if on_gpu:
            torch.cuda.synchronize()
        out = {}
        for key, spans in self.spans.items():
            out[key] = sum(
                (b - a) if isinstance(a, float) else a.elapsed_time(b) / 1000 for a, b in spans
            )
        return out


class Instrument:
    """Times the regions of one engine (scheduler, runner, model) into `record` while
    installed; `counter`, when given, counts each region's kernels."""

    def __init__(self, engine, on_gpu: bool):
        self.engine, self.on_gpu = engine, on_gpu
        self.regions: dict[str, Region] = {}
        self.record = StepRecord()
        self.counter: OpCounter | None = None
        self._find_regions()

    # -- which regions ------------------------------------------------------------------------

    def _add(self, key, label, parent, clock, cost, module=None) -> None:
        region = self.regions.setdefault(key, Region(key, label, parent, clock, cost))
        if module is not None:
            region.modules.append(module)

    def _find_regions(self) -> None:
        model = self.engine.runner.model
        for key, label in (("scheduler", "scheduler"), ("plan", "step plan (overlap, padding)"),
                           ("step inputs", "step inputs build")):
            self._add(key, label, None, "host", "host")
        self._add("forward", "forward", None, "device", "children")
        self._add("embed", "embedding", "forward", "device", "module", model.model.embed_tokens)
        # A family may name the feed-forward block otherwise (Mixtral: block_sparse_moe): its rows
        # are the feed-forward's all the same.
        mlp_name = getattr(model, "mlp_name", "mlp")
        for name, module in model.named_modules():
            if not LAYER_INDEX.match(name):
                continue
            part = _as_mlp(LAYER_INDEX.sub("", name), mlp_name)
            if part in LAYER_PARTS:
                label, parent = LAYER_PARTS[part]
                key = "layers.*" + (f".{part}" if part else "")
                self._add(key, label, parent, "device", "children" if part == "" else "module", module)
                if part == "mlp" and is_moe_block(module):
                    self._add("layers.*.mlp.router_logits", "router logits", key, "device", "gate", module)
                    self._add("layers.*.mlp.select", "router top-k", key, "device", "router", module)
                    self._add("layers.*.mlp.experts", "routed experts", key, "device", "experts", module)
        self._add("norm", "final norm", "forward", "device", "module", model.model.norm)
        self._add("sample", "sample (logits + sampler)", None, "device", "children")
        self._add("lm_head", "lm_head (logits)", "sample", "device", "logits")
        self._add("read samples", "read sampled ids (host sync)", None, "host", "host")
        self._add("apply", "apply outputs (stop checks, detokenize)", None, "host", "host")

    # -- timing ---------------------------------------------------------------------------------

    def _mark(self, clock: str):
        if clock == "device" and self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _begin(self, key: str):
        if self.counter is not None:
            self.counter.enter(key)
        if graph_capture_active():
            return None  # a capture runs nothing now (and may not record timing events): its replays are the work
        return self._mark(self.regions[key].clock)

    def _end(self, key: str, start, *tensors) -> None:
        """Closes a span; `tensors` are the call's activations (inputs and outputs)."""
        if self.counter is not None:
            self.counter.leave(key)
        if start is None:
            return
        self.record.spans[key].append((start, self._mark(self.regions[key].clock)))
        self.record.calls[key] += 1
        self.record.activation_bytes[key] += tensor_bytes(list(tensors))

    def _hook_module(self, stack: ExitStack, key: str, module: nn.Module) -> None:
        # The start of each open call, per context: DBO's ubatches (each in its own context)
        # interleave inside one module at their yields.
        starts: contextvars.ContextVar[tuple] = contextvars.ContextVar(f"profile_{key}_{id(module)}", default=())

        def pre(m, args):
            starts.set(starts.get() + (self._begin(key),))

        def post(m, args, out):
            *rest, start = starts.get()
            starts.set(tuple(rest))
            self._end(key, start, args, out)

        pre = module.register_forward_pre_hook(pre)
        post = module.register_forward_hook(post)
        stack.callback(pre.remove)
        stack.callback(post.remove)

    def _wrap(self, stack: ExitStack, key: str, obj, name: str, after=None, activations=None) -> None:
        """Times `obj.name(...)` (this instance only); `after(args, result)` sees each call;
        `activations(args, result)` picks the tensors counted as activations (default: all)."""
        original = getattr(obj, name)
        had_own = name in vars(obj)

        def timed(*args, **kwargs):
            start = self._begin(key)
            result = original(*args, **kwargs)
            self._end(key, start, *(activations(args, result) if activations else (args, result)))
            if after is not None:
                after(args, result)
            return result

        setattr(obj, name, timed)
        stack.callback(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    @contextmanager
    def installed(self) -> Iterator["Instrument"]:
        engine, runner = self.engine, self.engine.runner
        model = runner.model
        record = lambda: self.record  # noqa: E731 - the record is swapped per step
        with ExitStack() as stack:
            self._wrap(stack, "scheduler", engine.scheduler, "schedule")
            self._wrap(stack, "plan", runner, "plan_step")
            self._wrap(stack, "step inputs", runner, "step_inputs", after=lambda a, r: _note_shape(record(), a[0]))
            self._wrap(stack, "forward", runner, "forward", after=lambda a, r: _note_forward(record(), a[0]))
            self._wrap(stack, "sample", runner, "_sample_rows")
            self._wrap(stack, "lm_head", model, "compute_logits", after=lambda a, r: _note_rows(record(), a[0]))
            self._wrap(stack, "read samples", runner, "_read_samples")
            self._wrap(stack, "apply", engine, "_apply")
            for region in self.regions.values():
                if region.cost == "gate":
                    for block in region.modules:
                        self._wrap(stack, region.key, block, "router_logits")
                elif region.cost == "router":
                    for block in region.modules:
                        self._wrap(stack, region.key, block, "select",
                                   after=lambda a, r, b=block: record().topk_ids[id(b)].append(r[1]))
                elif region.cost == "experts":
                    for block in region.modules:
                        # apply(tokens, w1, w2): the weights are no activations.
                        self._wrap(stack, region.key, block.kernel.experts, "apply", activations=lambda a, r: (a[0], r))
                elif region.modules and region.key not in ("forward", "sample"):
                    for module in region.modules:
                        self._hook_module(stack, region.key, module)
            yield self


def _note_shape(record: StepRecord, chunks) -> None:
    record.shape = StepShape([len(c.token_ids) for c in chunks], [c.num_computed for c in chunks])


def _note_forward(record: StepRecord, x: torch.Tensor) -> None:
    record.forward_tokens += x.shape[0]
    record.forward_calls += 1


def _note_rows(record: StepRecord, hidden: torch.Tensor) -> None:
    record.sampled_rows += hidden.shape[0]


__all__ = ["Instrument", "LAYER_PARTS", "Region", "StepRecord"]
