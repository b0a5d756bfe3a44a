"""Fault injection for reliability tests, switched on by the `TANDEM_FAULT_INJECT` variable.

Unset (the normal case) nothing is installed and nothing is checked. Set, every
`ModelRunner` built in that process (so every rank of `tandem serve`, which inherit the
front end's environment) reads it once and installs a forward pre-hook on the decoder
layer each fault names. The value is one or more faults separated by `;`, each a comma-
separated list of `key=value`:

    kind     raise (default): raise `InjectedFault` before the layer runs
             sleep: sleep `seconds` there (a slow rank; a long sleep is a hung one)
             exit: end the process at once with exit code `code` (a rank dying mid-step)
    layer    index of the decoder layer the fault precedes (default 0)
    ubatch   only inside this ubatch of a DBO step (default: any forward, split or not)
    rank     only on this DP rank (default: every rank, as a model bug would; faulting every
             rank at the same point keeps their MoE all-to-alls matched)
    step     only from this runner step on: the runner's count of forwards since it was
             built (the first is 1), warm-up and idle-rank dummy steps included, so the same
             on every rank of a lockstep engine (default 0: from the start)
    count    how many times the fault fires in this process (default 1)
    seconds  for kind=sleep (default 1.0)
    code     for kind=exit (default 1)

Example: `TANDEM_FAULT_INJECT="ubatch=1,layer=2"` fails the first DBO step of the server in
ubatch 1 before its decoder layer 2, on every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from tandem.contexts.ubatch_context import current_ubatch_context

ENV_VAR = "TANDEM_FAULT_INJECT"
KINDS = ("raise", "sleep", "exit")


class InjectedFault(RuntimeError):
    """The exception a `kind=raise` fault raises."""


@dataclass
class FaultSpec:
    kind: str = "raise"
    layer: int = 0
    ubatch: int | None = None
    rank: int | None = None
    step: int = 0
    count: int = 1
    seconds: float = 1.0
    code: int = 1
    fired: int = 0

    def describe(self) -> str:
        where = [f"layer {self.layer}"]
        if self.ubatch is not None:
            where.append(f"ubatch {self.ubatch}")
        return " ".join(where)


_INT_FIELDS = {"layer", "ubatch", "rank", "step", "count", "code"}


def parse_faults(text: str) -> list[FaultSpec]:
    """`text` in the `TANDEM_FAULT_INJECT` format; a malformed value raises ValueError."""
    faults = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        spec = FaultSpec()
        for item in part.split(","):
            key, sep, value = item.strip().partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise ValueError(f"{ENV_VAR}: expected key=value, got {item.strip()!r}")
            if key == "kind":
                if value not in KINDS:
                    raise ValueError(f"{ENV_VAR}: kind must be one of {KINDS}, got {value!r}")
                spec.kind = value
            elif key in _INT_FIELDS:
                try:
                    setattr(spec, key, int(value))
                except ValueError:
                    raise ValueError(f"{ENV_VAR}: {key} must be an integer, got {value!r}") from None
            elif key == "seconds":
                try:
                    spec.seconds = float(value)
                except ValueError:
                    raise ValueError(f"{ENV_VAR}: seconds must be a number, got {value!r}") from None
            else:
                raise ValueError(f"{ENV_VAR}: unknown key {key!r}")
        faults.append(spec)
    return faults


def _decoder_layers(model: Any) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return list(layers)
    if hasattr(model, "attention_layers"):
        return list(model.attention_layers())
    raise ValueError(f"{ENV_VAR}: cannot find the decoder layers of {type(model).__name__}")


def _current_ubatch() -> int | None:
    ctx = current_ubatch_context()
    return None if ctx is None else ctx.id


def _hook(spec: FaultSpec, rank: int, step_of: Callable[[], int]):
    def pre_hook(module, args):
        if spec.fired >= spec.count:
            return None
        step = step_of()
        if step < spec.step:
            return None
        ubatch = _current_ubatch()
        if spec.ubatch is not None and ubatch != spec.ubatch:
            return None
        spec.fired += 1
        where = f"rank {rank}, step {step}, {'ubatch ' + str(ubatch) + ', ' if ubatch is not None else ''}layer {spec.layer}"
        if spec.kind == "raise":
            raise InjectedFault(f"injected fault ({where})")
        if spec.kind == "sleep":
            time.sleep(spec.seconds)
            return None
        os._exit(spec.code)

    return pre_hook


def install_faults(model: Any, faults: list[FaultSpec], *, rank: int, step_of: Callable[[], int]) -> list:
    """Install the faults that apply to `rank` on `model`'s decoder layers; returns the hook
    handles (`.remove()` uninstalls). `step_of()` gives the current step number."""
    layers = _decoder_layers(model)
    handles = []
    for spec in faults:
        if spec.rank is not None and spec.rank != rank:
            continue
        if not 0 <= spec.layer < len(layers):
            raise ValueError(f"{ENV_VAR}: layer {spec.layer} out of range (the model has {len(layers)})")
        handles.append(layers[spec.layer].register_forward_pre_hook(_hook(spec, rank, step_of)))
    return handles


def install_from_env(runner: Any) -> list:
    """Called by every `ModelRunner`: install the faults of `TANDEM_FAULT_INJECT`, if set."""
    text = os.environ.get(ENV_VAR, "")
    if not text.strip():
        return []
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return install_faults(runner.model, parse_faults(text), rank=rank, step_of=lambda: runner.steps)


__all__ = ["ENV_VAR", "FaultSpec", "InjectedFault", "install_faults", "install_from_env", "parse_faults"]
